"""Draw held-out pass@1 against iteration and against wall seconds, one line per run.

Reads what ``bench.smollm2_learning --out FILE`` writes (``rows``: the metrics
rows, with ``eval_*`` columns at evaluated iterations and the base model's as
``eval_base_*`` of row 1; ``walls``: each iteration's seconds) and draws
docs/smollm2-learning.png, the README's learning curve:

    .venv/bin/python -m bench.plot_learning                   # the two SmolLM2 H100 runs
    .venv/bin/python -m bench.plot_learning --run "staleness 0=a.json" --out x.png

Wall seconds count from iteration 1's rollout (the engines' start and the base
model's evaluation before it are excluded; ``walls`` are the seconds between
the ledger commits of consecutive iterations). An evaluation of iteration k
runs inside iteration k, after its reload, so it is drawn at the end of k's
seconds; the base model's at 0.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RUNS = (
    ("staleness 0", ROOT / "bench/results/smollm2_gpu_s0_seed0.json"),
    ("staleness 1", ROOT / "bench/results/smollm2_gpu_s1_seed0.json"),
)
OUT = ROOT / "docs/smollm2-learning.png"
TITLE = "SmolLM2-135M-Instruct, 2-digit addition, one H100 (SGLang + torch trainer)"


def curve(result: dict[str, Any], key: str) -> tuple[list[int], list[float], list[float]]:
    """(iterations, wall seconds at their end, scores) of one eval column, base first."""
    rows, walls = result["rows"], result["walls"]
    its, secs, scores = [], [], []
    base = rows[0].get(key.replace("eval_", "eval_base_", 1)) if rows else None
    if base is not None:
        its, secs, scores = [0], [0.0], [base]
    elapsed = 0.0
    for row, wall in zip(rows, walls):
        elapsed += wall
        if row.get(key) is not None:
            its.append(row["iteration"])
            secs.append(elapsed)
            scores.append(row[key])
    return its, secs, scores


def draw(runs: list[tuple[str, Path]], out: Path, title: str = TITLE) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "bench.plot_learning needs matplotlib, a dependency of prefect-rl: pip install -e ."
        ) from None
    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    fig, (by_it, by_s) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=110, sharey=True)
    for i, (label, path) in enumerate(runs):
        result = json.loads(path.read_text())
        color = f"C{i}"
        for key, style, what in (
            ("eval_pass_at_1_greedy", "-", "greedy"),
            ("eval_pass_at_1", "--", "sampled"),
        ):
            its, secs, scores = curve(result, key)
            kw = {"color": color, "ls": style, "marker": "o", "ms": 3}
            by_it.plot(its, scores, label=f"{label}, {what}", **kw)
            by_s.plot(secs, scores, **kw)
    by_it.set_xlabel("iteration")
    by_s.set_xlabel("wall seconds from iteration 1 (engine start excluded)")
    by_it.set_ylabel("held-out pass@1 (256 prompts)")
    by_it.set_ylim(0, 1)
    for ax in (by_it, by_s):
        ax.grid(alpha=0.3)
    by_it.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="LABEL=JSON",
        help="a run to draw (repeat); default: the SmolLM2 H100 runs at staleness 0 and 1",
    )
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--title", default=TITLE)
    args = parser.parse_args()
    runs = [(s.split("=", 1)[0], Path(s.split("=", 1)[1])) for s in args.run] or list(RUNS)
    draw(runs, args.out, args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
