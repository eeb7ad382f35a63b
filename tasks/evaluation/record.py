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
numbers as ``eval/{label}/...`` at step = the version, once: the record's
``logged`` names the trackers that hold a version's numbers, and a rerun whose
shards of that version all come from the cache skips them. No Prefect.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from storage.fs import join, read_json, write_json
from tasks.evaluation.plan import EvalPlan
from tasks.tracking import RunTrackers

EVALS = "evals"


def record_url(plan: EvalPlan) -> str:
    return join(plan.ctx.store.url, EVALS, f"{plan.label}.json")


def write_record(
    plan: EvalPlan, scores: list[dict[str, Any]], holding: dict[int, list[str]]
) -> dict[str, Any]:
    """Merge ``scores`` (one per version) into ``evals/{label}.json``, with ``holding``:
    by version, the trackers that hold its numbers (``logged``); the record written."""
    store, url = plan.ctx.store, record_url(plan)
    old = read_json(store.fs, url) or {}
    by_version = {str(k): v for k, v in (old.get("versions") or {}).items()}
    logged = {str(v): t for v, t in _logged(old).items()}
    for row in scores:
        by_version[str(row["version"])] = row
        logged[str(row["version"])] = sorted(holding.get(row["version"], []))
    record = {
        **plan.summary(),
        "versions": dict(sorted(by_version.items(), key=lambda kv: int(kv[0]))),
        "logged": {v: t for v, t in sorted(logged.items(), key=lambda kv: int(kv[0])) if t},
        "written": datetime.now(timezone.utc).isoformat(),
    }
    record["evaluated_now"] = [row["version"] for row in scores]
    write_json(store.fs, url, record)
    return record


def trackers_holding(plan: EvalPlan, rescored: set[int]) -> dict[int, list[str]]:
    """By version, the trackers that already hold the numbers this evaluation reports:
    those its record says were logged, for each version none of whose shards was
    scored anew (its numbers are the cached shards', as logged). A rerun logs only
    to the others, so a chart gets no second point at a version."""
    logged = _logged(read_record(plan) or {})
    return {v: t for v, t in logged.items() if v in plan.versions and v not in rescored}


def _logged(record: dict[str, Any]) -> dict[int, list[str]]:
    """The record's ``logged`` entries that read as version -> tracker names. An entry
    that does not (a record edited by hand) counts as never logged: the version is
    logged again, a second point at worst, and no number is lost."""
    raw = record.get("logged")
    if not isinstance(raw, dict):
        return {}
    return {
        int(v): list(t)
        for v, t in raw.items()
        if str(v).isdigit() and isinstance(t, list) and all(isinstance(x, str) for x in t)
    }


def read_record(plan: EvalPlan) -> dict[str, Any] | None:
    return read_json(plan.ctx.store.fs, record_url(plan))


def log_trackers(
    plan: EvalPlan, scores: list[dict[str, Any]], holding: dict[int, list[str]]
) -> dict[int, list[str]]:
    """Each version's numbers to the run's enabled trackers that do not hold them yet
    (``holding``); by version, the trackers that hold them now."""
    cfg = plan.ctx.cfg
    trackers = RunTrackers(cfg.tracking, cfg.storage, cfg.run.name)
    held = {row["version"]: list(holding.get(row["version"], [])) for row in scores}
    if not trackers.enabled():
        return held
    try:
        for row in scores:
            v, metrics = row["version"], {k: x for k, x in row.items() if k != "version"}
            held[v] += trackers.log(v, {f"eval/{plan.label}": metrics}, True, held[v])
    finally:
        trackers.close()
    return held
