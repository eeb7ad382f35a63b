"""The one check that an engine serves the version it should, and its audit record.

Used by the iteration's verify step (``tasks.steps``), the maintenance flows'
``check_engine`` (``flows.maintenance_tasks``) and the evaluation's engines
(``tasks.evaluation.engines``). The check itself is read-only; only the
iteration's verify restarts a dead engine first, and commits what it saw as
``ledger/iter_k/verify-e{i}.json`` (rewritten on every pass: verify looks at
what engines serve now, so its record is an audit, not a cache).
"""

from __future__ import annotations

from datetime import datetime, timezone

from rollout.procedure import VersionMismatch
from tasks.serving.engine import served_version

__all__ = ["VersionMismatch", "check_serves", "now", "rollout_version"]


def check_serves(ctx, group, engine_id: int, version: int, fix: str, when: str = "") -> str:
    """The version engine ``engine_id`` serves; VersionMismatch naming ``fix`` unless it is ``version``."""
    served = served_version(ctx, group, engine_id)
    if served != str(version):
        raise VersionMismatch(
            f"engine {engine_id} serves weight version {served!r}, expected {str(version)!r}"
            f"{when}; {fix}"
        )
    return served


def rollout_version(ctx, k: int) -> int | None:
    """The weight_version the rollout record of iteration k carries (None: no record)."""
    record = ctx.store.read_record(k, "rollout")
    return None if record is None else record["result"].get("weight_version")


def now() -> str:
    return datetime.now(timezone.utc).isoformat()
