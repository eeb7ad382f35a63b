"""The iteration's metrics row: what ``metrics.jsonl``, the UI's table and the
trackers show of iteration k, made by the finish step from its steps' results.

Each part that adds columns owns them (``rollout.evaluation.row_fields``,
``rollout.agent.tool_row_fields``, ``rollout.dynamic_sampling.sampling_row_fields``,
``training.types.MISMATCH_METRICS``); this module puts them in one row. The row's
type is ``tasks.types.IterationRow``. No Prefect, no Ray.
"""

from __future__ import annotations

from typing import Any

from rollout.agent import tool_row_fields
from rollout.dynamic_sampling import sampling_row_fields
from rollout.evaluation import row_fields
from tasks.rollouts.versions import made_on
from training.types import MISMATCH_METRICS

BASE_EVAL = "evaluate_base"  # finish[1]'s input: the base model's evaluation (evaluate[0])


def metrics_row(
    ctx, k: int, results: dict[str, dict[str, Any]], reloads: list[dict[str, Any]]
) -> dict[str, Any]:
    """Iteration k's row from its steps' results by ledger key (``reloads``: each
    engine's reload result)."""
    r, t, p = results["rollout"], results["train"], results["publish"]
    return {
        "iteration": k,
        "reward_mean": r["reward_mean"],
        # The weights that made the batch: reward_mean measures them, not the newest.
        "rollout_version": made_on(ctx, k),
        **{key: t.get(key) for key in ("loss", "kl", *MISMATCH_METRICS)},
        # train.mismatch's gate: True where the KL above is over max_kl for a batch the
        # trainer's own weights made; None where the gate does not apply.
        "rollout_logprob_kl_over": t.get("rollout_logprob_kl_over"),
        "gen_tokens_per_s": r.get("gen_tokens_per_s"),
        "train_tokens_per_s": t.get("tokens_per_s"),
        "publish_s": p.get("publish_s"),
        "reload_s": max((x.get("reload_s") or 0.0 for x in reloads), default=0.0),
        "sync_bytes": sync_bytes(p, reloads),
        "example": r.get("example"),
        **row_fields(results.get("evaluate")),
        **row_fields(results.get(BASE_EVAL), prefix="eval_base"),
        **tool_row_fields(r.get("tools")),
        **sampling_row_fields(r.get("sampling")),
    }


def sync_bytes(publish: dict[str, Any], reloads: list[dict[str, Any]]) -> int | None:
    """The most bytes one engine received to serve this iteration's weights: what was
    pushed to it or pulled into its node's cache; else, where engines read the version
    folder itself, the version's stored bytes (a LoRA adapter's, a delta's). None when
    neither is known (a version still written in the background)."""
    moved = [(x.get("push") or x.get("pull") or {}).get("bytes") for x in reloads]
    known = [b for b in moved if b is not None]
    return max(known) if known else publish.get("bytes")
