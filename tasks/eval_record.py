"""Where an evaluation's results go besides the UI: a JSON record under the run's
``evals/`` and the run's trackers.

``evals/{label}.json`` (label: dataset, size, n_samples, temperature) holds the
scores of every version evaluated with those parameters, by version; a later
evaluation of other versions adds to it, one of the same version replaces it.
The file is written whole and atomically (``storage.fs.write_json``: a rename on
disk, one PUT on S3), so a reader sees the old record or the new one. It is the
only thing an evaluation writes into a run, beside Prefect's persisted shard
results; it takes no lease (two evaluations of one label at once: the last
writer's versions win, neither record is torn). Trackers get each version's
numbers as ``eval/{label}/...`` at step = the version. No Prefect.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from storage.fs import join, read_json, write_json
from tasks.eval_plan import EvalPlan
from tasks.tracking import RunTrackers

EVALS = "evals"


def record_url(plan: EvalPlan) -> str:
    return join(plan.ctx.store.url, EVALS, f"{plan.label}.json")


def write_record(plan: EvalPlan, scores: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge ``scores`` (one per version) into ``evals/{label}.json``; the record written."""
    store, url = plan.ctx.store, record_url(plan)
    old = read_json(store.fs, url) or {}
    by_version = {str(k): v for k, v in (old.get("versions") or {}).items()}
    for row in scores:
        by_version[str(row["version"])] = row
    record = {
        **plan.summary(),
        "versions": dict(sorted(by_version.items(), key=lambda kv: int(kv[0]))),
        "written": datetime.now(timezone.utc).isoformat(),
    }
    record["evaluated_now"] = [row["version"] for row in scores]
    write_json(store.fs, url, record)
    return record


def read_record(plan: EvalPlan) -> dict[str, Any] | None:
    return read_json(plan.ctx.store.fs, record_url(plan))


def log_trackers(plan: EvalPlan, scores: list[dict[str, Any]]) -> list[str]:
    """Each version's numbers to the run's enabled trackers; the trackers used."""
    cfg = plan.ctx.cfg
    trackers = RunTrackers(cfg.tracking, cfg.storage, cfg.run.name)
    if not trackers.enabled():
        return []
    used: set[str] = set()
    try:
        for row in scores:
            metrics = {k: v for k, v in row.items() if k != "version"}
            used.update(trackers.log(row["version"], {f"eval/{plan.label}": metrics}, True))
    finally:
        trackers.close()
    return sorted(used)
