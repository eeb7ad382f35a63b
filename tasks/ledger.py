"""Ledger-first execution: a step that is committed returns its recorded result.

Every step of an iteration goes through ``run_step``. The ledger in storage is
the source of truth, so a retried task, a rerun flow and a plain-Python driver
all skip exactly the same finished work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

log = logging.getLogger("prefect_rl.steps")


def run_step(ctx, k: int, step: str, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Return the committed result of (run, k, step), or do the work and commit it."""
    store = ctx.store
    record = store.read_record(k, step)
    if record is not None:
        return {**record["result"], "cached": True, "step_s": record.get("seconds", 0.0)}
    t0 = time.perf_counter()
    result = work()
    seconds = time.perf_counter() - t0
    store.write_record(
        k,
        step,
        {
            "run": ctx.run_name,
            "iteration": k,
            "step": step,
            "result": result,
            "seconds": round(seconds, 4),
            "committed_at": datetime.now(timezone.utc).isoformat(),
        },
    )
    return {**result, "cached": False, "step_s": round(seconds, 4)}
