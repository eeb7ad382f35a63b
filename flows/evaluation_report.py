"""The evaluate-versions flow's artifacts: a table of scores per version and a
picture of them (PNG, embedded as a data URL, as the run's reward curve is)."""

from __future__ import annotations

import base64
import io
from typing import Any

from prefect.artifacts import create_image_artifact, create_table_artifact

from flows.artifacts import artifact_key

# The columns of the table and the curves of the picture, in order.
COLUMNS = (
    ("pass_at_1_greedy", "pass@1 (greedy)"),
    ("pass_at_1", "pass@1 (sampled)"),
    ("pass_at_k", "pass@{k}"),
    ("reward_mean", "mean reward (sampled)"),
)


def scores_png(scores: list[dict[str, Any]], title: str) -> bytes:
    """Each score against the version (one line per score, all on [0, 1])."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    xs = [row["version"] for row in scores]
    for key, label in COLUMNS:
        name = label.format(k=scores[0]["n_samples"]) if scores else label
        ax.plot(xs, [row[key] for row in scores], marker="o", ms=3, label=name)
    ax.set_xticks(xs)
    ax.set_xlabel("version")
    ax.set_ylabel("score")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def publish_artifacts(run: str, label: str, scores: list[dict[str, Any]], record_url: str) -> None:
    """The table (one row per version) and the picture, keyed by run and label."""
    k = scores[0]["n_samples"]
    table = [
        {
            "version": row["version"],
            **{name.format(k=k): round(row[key], 4) for key, name in COLUMNS},
            "tokens": row["response_tokens"],
            "prompts": row["prompts"],
        }
        for row in scores
    ]
    key = artifact_key(run, f"eval-{label}")
    create_table_artifact(
        table=table, key=key, description=f"{run}: {label} per version ({record_url})"
    )
    png = scores_png(scores, f"{run}: {label}")
    create_image_artifact(
        image_url="data:image/png;base64," + base64.b64encode(png).decode(),
        key=f"{key}-plot",
        description=f"{run}: {label}, score per version",
    )
