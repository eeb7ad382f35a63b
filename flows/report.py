"""Run reports without Prefect: the reward curve as PNG and the markdown summary."""

from __future__ import annotations

import io
from typing import Any

# The eval columns of a metrics row (rollout.evaluation.row_fields) and their legend.
EVAL_CURVES = (
    ("eval_pass_at_1_greedy", "eval pass@1 (greedy)"),
    ("eval_pass_at_1", "eval pass@1 (sampled)"),
    ("eval_pass_at_k", "eval pass@{k}"),
)


def eval_points(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluations of a run in order, as rows of eval columns: the base model's
    (iteration 0, from iteration 1's eval_base_* columns) first when there is one."""
    points = []
    if rows and rows[0].get("eval_base_pass_at_1") is not None:
        base = {key: rows[0][key.replace("eval_", "eval_base_", 1)] for key, _ in EVAL_CURVES}
        points.append({"iteration": 0, "eval_k": rows[0].get("eval_base_k"), **base})
    return points + [r for r in rows if r.get("eval_pass_at_1") is not None]


def reward_curve_png(rows: list[dict[str, Any]], title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    ax.plot(
        [r["iteration"] for r in rows],
        [r["reward_mean"] for r in rows],
        marker="o",
        ms=3,
        label="mean reward",
    )
    # Evaluated iterations (eval.interval) add their pass rates, on the same [0, 1] scale;
    # the base model's (eval.before_training, in iteration 1's row) at iteration 0.
    evaluated = eval_points(rows)
    for key, label in EVAL_CURVES:
        if evaluated:
            xs = [r["iteration"] for r in evaluated]
            name = label.format(k=evaluated[-1].get("eval_k"))
            ax.plot(xs, [r[key] for r in evaluated], marker="s", ms=3, ls="--", label=name)
    if evaluated:
        ax.legend(fontsize=7)
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward / pass rate" if evaluated else "mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def summary_markdown(
    run: str,
    store_url: str,
    rows: list[dict[str, Any]],
    versions: list[int],
    step_seconds: dict[str, float],
    serving: dict[int, int],
) -> str:
    lines = [f"# Run `{run}`", "", f"Storage: `{store_url}`", ""]
    if rows:
        first, last = rows[0], rows[-1]
        lines += [
            f"Iterations {first['iteration']}..{last['iteration']}: reward "
            f"{first['reward_mean']:.3f} -> {last['reward_mean']:.3f}",
            "",
        ]
        points = eval_points(rows)
        for e in points if len(points) <= 2 else [points[0], points[-1]]:  # first and last
            at = "of the base model" if e["iteration"] == 0 else f"at iteration {e['iteration']}"
            lines += [
                f"Evaluation {at}: pass@1 greedy "
                f"{e['eval_pass_at_1_greedy']:.3f}, pass@1 sampled {e['eval_pass_at_1']:.3f}, "
                f"pass@{e['eval_k']} {e['eval_pass_at_k']:.3f}",
                "",
            ]
    lines += [
        "## Versions",
        "",
        f"Committed: {', '.join(f'v{v}' for v in versions) or 'none'}  ",
        f"Location: `{store_url}/weights/v{{k:06d}}`",
        "",
    ]
    lines += [
        "## Seconds per step (total over this flow run)",
        "",
        "| step | seconds |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v:.2f} |" for k, v in step_seconds.items()]
    lines += ["", "## Engines", "", "| engine | serves |", "|---|---|"]
    lines += [f"| {e} | v{v} |" for e, v in sorted(serving.items())]
    return "\n".join(lines)
