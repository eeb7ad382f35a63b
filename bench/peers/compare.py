"""Held-out pass@1 against wall-clock seconds: the project and its peers, side by side.

    python -m bench.peers.compare smollm2_gpu_s0_seed0.json trl.json verl.json

Reads result files of ``bench.smollm2_learning`` (the project) and of the peer
runners (``system``: trl, verl), and prints per system: start-up, seconds per
iteration (and its generation and training parts where the file has them),
held-out greedy pass@1 at each evaluation with the iteration wall-clock seconds
spent to reach it, the seconds to the first evaluation at pass@1 >= 0.5 (with
and without start-up), peak GPU memory; then pass@1 on a common time axis, and
the machine and versions each file records.

The clock is the iteration wall with evaluations left out. A peer's file
already leaves them out; the project's walls include each ``evaluate[k]`` step,
so an evaluated iteration's wall is reduced by the base model's evaluation
seconds (the same prompts and engine; an estimate, said in the output). The
project's file holds no start-up: it is the command's wall (the ``wall N s``
line of the ``.txt`` beside the file, when there is one) less the iterations
and the base model's evaluation, so it also holds the run's preparation, the
engine start and the shutdown.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

TARGET = 0.5  # the issue's pass@1 mark


def load(path: str) -> dict[str, Any]:
    """One system's curve: name, walls without evaluation, evaluations, start-up."""
    data = json.loads(Path(path).read_text())
    system = data.get("system", "project")
    walls = list(data["walls"])
    note = None
    if system == "project":
        eval_s = (data.get("base") or {}).get("eval_s") or 0.0
        for i, row in enumerate(data["rows"]):
            if row.get("eval_pass_at_1_greedy") is not None and eval_s:
                walls[i] = max(0.0, walls[i] - eval_s)
        if eval_s:
            note = f"evaluated iterations less {eval_s:.1f} s (the base evaluation's seconds)"
    points = []  # (iteration, seconds of iteration wall so far, pass@1)
    base = data.get("base") or {}
    if base.get("pass_at_1_greedy") is not None:
        points.append((0, 0.0, base["pass_at_1_greedy"]))
    spent = 0.0
    for row, wall in zip(data["rows"], walls):
        spent += wall
        if row.get("eval_pass_at_1_greedy") is not None:
            points.append((row["iteration"], spent, row["eval_pass_at_1_greedy"]))
    startup = data.get("startup_s")
    if startup is None and system == "project":
        total = _project_wall(Path(path).with_suffix(".txt"))
        if total is not None:
            startup = total - sum(data["walls"]) - (base.get("eval_s") or 0.0)
    gens = [r["gen_s"] for r in data["rows"][1:] if r.get("gen_s") is not None]
    trains = [r["train_s"] for r in data["rows"][1:] if r.get("train_s") is not None]
    return {
        "system": system,
        "path": path,
        "walls": walls,
        "points": points,
        "startup_s": startup,
        "gen_s": statistics.median(gens) if gens else None,
        "train_s": statistics.median(trains) if trains else None,
        "peak_gb": data.get("peak_gpu_memory_gb"),
        "machine": data.get("machine"),
        "versions": data.get("versions"),
        "commit": data.get("commit"),
        "wall_note": note,
        "reward": [r.get("reward_mean") for r in data["rows"]],
    }


def _project_wall(txt: Path) -> float | None:
    """The command's wall seconds, from bench.smollm2_learning's last line."""
    if not txt.is_file():
        return None
    m = re.search(r"wall (\d+) s \(\d+ s in iterations\)", txt.read_text())
    return float(m.group(1)) if m else None


def to_target(points: list[tuple[int, float, float]]) -> tuple[int, float] | None:
    """The first evaluation at pass@1 >= TARGET: (iteration, iteration seconds)."""
    return next(((k, t) for k, t, p in points if p >= TARGET), None)


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(curves: list[dict[str, Any]]) -> list[str]:
    w = max(8, *(len(c["system"]) for c in curves))
    lines = [
        f"{'system':<{w}} {'start-up s':>10} {'iter s':>7} {'gen s':>6} {'train s':>7} "
        f"{'pass@1 >= 0.5 at: k, iter s, +start-up s':>42} {'last pass@1':>11} {'peak GB':>8}"
    ]
    for c in curves:
        steady = c["walls"][1:] or c["walls"]
        hit = to_target(c["points"])
        reach = "not reached"
        if hit:
            with_start = hit[1] + c["startup_s"] if c["startup_s"] is not None else None
            reach = f"{hit[0]}, {hit[1]:.1f}, {_fmt(with_start)}"
        last = c["points"][-1][2] if c["points"] else None
        lines.append(
            f"{c['system']:<{w}} {_fmt(c['startup_s']):>10} {statistics.median(steady):>7.2f} "
            f"{_fmt(c['gen_s'], '.2f'):>6} {_fmt(c['train_s'], '.2f'):>7} {reach:>42} "
            f"{_fmt(last, '.3f'):>11} {_fmt(c['peak_gb']):>8}"
        )
    return lines


def across_seeds(curves: list[dict[str, Any]]) -> list[str]:
    """Per system with more than one file (one per seed): the median and the range of
    seconds per iteration, iteration seconds to pass@1 0.5 and the last pass@1; the
    range is the noise a single run's figure carries."""
    families: dict[str, list[dict[str, Any]]] = {}
    for c in curves:
        families.setdefault(c["system"].split(":")[0], []).append(c)

    def spread(xs: list[float], spec: str) -> str:
        if not xs:
            return "-"
        mid = statistics.median(xs)
        return f"{mid:{spec}} ({min(xs):{spec}}-{max(xs):{spec}})"

    lines = [
        f"{'system':<8} {'runs':>4} {'iter s':>18} {'iter s to pass@1 0.5':>22} "
        f"{'reached':>7} {'last pass@1':>21}"
    ]
    for name, group in families.items():
        if len(group) < 2:
            continue
        iters = [statistics.median(c["walls"][1:] or c["walls"]) for c in group]
        hits = [h[1] for h in (to_target(c["points"]) for c in group) if h]
        last = [c["points"][-1][2] for c in group if c["points"]]
        lines.append(
            f"{name:<8} {len(group):>4} {spread(iters, '.2f'):>18} {spread(hits, '.1f'):>22} "
            f"{len(hits):>4}/{len(group):<2} {spread(last, '.3f'):>21}"
        )
    return lines if len(lines) > 1 else []


def evaluations(curves: list[dict[str, Any]]) -> list[str]:
    """Each evaluation: pass@1 and the iteration seconds spent by then."""
    ks = sorted({k for c in curves for k, _, _ in c["points"]})
    w = max(22, *(len(c["system"]) + 11 for c in curves))
    lines = [f"{'k':>4} " + " ".join(f"{c['system'] + ' pass@1 (s)':>{w}}" for c in curves)]
    for k in ks:
        cells = []
        for c in curves:
            hit = next(((t, p) for kk, t, p in c["points"] if kk == k), None)
            cells.append(f"{f'{hit[1]:.3f} ({hit[0]:.1f})' if hit else '':>{w}}")
        lines.append(f"{k:>4} " + " ".join(cells))
    return lines


def timeline(curves: list[dict[str, Any]], every: float | None) -> list[str]:
    """pass@1 of the newest evaluation done by each mark of iteration seconds."""
    end = max(c["points"][-1][1] for c in curves if c["points"])
    step = every or _nice(end / 12)
    w = max(8, *(len(c["system"]) for c in curves))
    lines = [f"{'s':>6} " + " ".join(f"{c['system']:>{w}}" for c in curves)]
    t = 0.0
    while t <= end + step:
        cells = []
        for c in curves:
            done = [p for _, tt, p in c["points"] if tt <= t]
            cells.append(f"{_fmt(done[-1] if done else None, '.3f'):>{w}}")
        lines.append(f"{t:>6.0f} " + " ".join(cells))
        t += step
    return lines


def _nice(x: float) -> float:
    for step in (1, 2, 5, 10, 15, 20, 30, 60, 120, 300):
        if x <= step:
            return float(step)
    return 600.0


def provenance(curves: list[dict[str, Any]]) -> list[str]:
    lines = []
    for c in curves:
        m = c["machine"] or {}
        gpu = m.get("gpu") or ("not recorded" if not m else "no GPU")
        vs = ", ".join(f"{k} {v}" for k, v in (c["versions"] or {}).items() if v)
        lines.append(
            f"{c['system']}: {c['path']} (commit {c['commit'] or 'not recorded'}); "
            f"machine {gpu}{', ' + str(m.get('cpus')) + ' CPUs' if m.get('cpus') else ''}; "
            f"{vs or 'versions not recorded'}"
        )
        if c["wall_note"]:
            lines.append(f"  {c['system']} walls: {c['wall_note']}")
    return lines


def plot(curves: list[dict[str, Any]], out: Path) -> None:
    """The figure: held-out pass@1 and batch reward against iteration wall-clock
    seconds, one colour per system and one line per file (seeds of a system share
    its colour, so their spread is the noise); the dotted line is pass@1 0.5."""
    import matplotlib

    matplotlib.use("Agg")  # no display on the GPU machine
    import matplotlib.pyplot as plt

    fig, (ax_p, ax_r) = plt.subplots(1, 2, figsize=(11, 4.2))
    colours: dict[str, str] = {}
    for c in curves:
        family = c["system"].split(":")[0]
        colour = colours.setdefault(family, f"C{len(colours)}")
        label = (
            family
            if c["system"] == family or family not in {ln.get_label() for ln in ax_p.lines}
            else None
        )
        ts, ps = [t for _, t, _ in c["points"]], [p for _, _, p in c["points"]]
        ax_p.plot(ts, ps, "o-", color=colour, label=label, alpha=0.85)
        ends = [sum(c["walls"][: i + 1]) for i in range(len(c["walls"]))]
        rewards = [(t, r) for t, r in zip(ends, c["reward"]) if r is not None]
        if rewards:
            ax_r.plot(*zip(*rewards), "-", color=colour, label=label, alpha=0.85)
    ax_p.axhline(TARGET, color="grey", linestyle=":", linewidth=1)
    ax_p.set(xlabel="iteration wall-clock s (evaluation left out)", ylabel="held-out pass@1")
    ax_r.set(xlabel="iteration wall-clock s", ylabel="batch reward (mean)")
    for ax in (ax_p, ax_r):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("The project beside its peers on one card: the same task, prompts and reward")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="result JSON files: the project's and peers'")
    parser.add_argument("--every", type=float, default=None, help="seconds between time marks")
    parser.add_argument("--plot", type=Path, help="also draw the figure to this PNG")
    args = parser.parse_args()
    curves = [load(f) for f in args.files]
    names = [c["system"] for c in curves]
    for c in curves:
        if names.count(c["system"]) > 1:
            c["system"] = f"{c['system']}:{Path(c['path']).stem}"
    print(
        "held-out greedy pass@1 (the project's evaluation prompts and reward) against "
        "iteration wall-clock seconds, evaluations left out"
    )
    print("\n".join(table(curves)))
    print()
    summary = across_seeds(curves)
    if summary:
        print("median (min-max) over each system's runs")
        print("\n".join(summary))
        print()
    print("\n".join(evaluations(curves)))
    print()
    print("\n".join(timeline(curves, args.every)))
    print()
    print("\n".join(provenance(curves)))
    if args.plot:
        plot(curves, args.plot)


if __name__ == "__main__":
    main()
