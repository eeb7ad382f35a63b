"""Prefect tasks of the maintenance flows: point one engine at a version, start
one on a version, check one engine, publish a checkpoint, collect garbage.
Mapped per engine like the iteration's reload and verify. Each wraps the work of
``tasks.serving`` (or ``RunContext.gc``); none is cached: each looks at the
run and its engines as they are now."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.context import RunContext
from tasks.serving import versions
from tasks.serving.transports import ensure_engine_serves, start_on
from tasks.serving.verify import check_serves


@task(
    name="point_engine",
    task_run_name="{ctx.run_name}:point[engine={engine_id},v={version}]",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=[2, 5],
)
def point_engine(ctx: RunContext, version: int, engine_id: int) -> dict[str, Any]:
    ensure_engine_serves(ctx, ctx.engines(), engine_id, version, force_reload=True)
    return {"engine": engine_id, "version": version}


@task(
    name="start_engine",
    task_run_name="{ctx.run_name}:start[engine={engine_id},v={version}]",
    cache_policy=NO_CACHE,
)
def start_engine(ctx: RunContext, version: int, engine_id: int) -> dict[str, Any]:
    """Start engine ``engine_id`` on ``version`` (read-only: no serving record written)."""
    start_on(ctx, ctx.engines(), engine_id, version)
    return {"engine": engine_id, "version": version, "started": True}


@task(
    name="check_engine",
    task_run_name="{ctx.run_name}:check[engine={engine_id},v={version}]",
    cache_policy=NO_CACHE,
)
def check_engine(
    ctx: RunContext, version: int, engine_id: int, upstream: Any = None
) -> dict[str, Any]:
    # The iteration's verify check (``tasks.serving.verify``); read-only here, and no
    # audit record: the verify-engines flow holds no lease, so it cannot commit.
    check_serves(
        ctx,
        ctx.engines(),
        engine_id,
        version,
        fix="run the reload-engines deployment for this version",
    )
    return {"engine": engine_id, "version": version, "verified": True}


@task(
    name="publish_checkpoint",
    task_run_name="{ctx.run_name}:publish-checkpoint[k={k}]",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=[2, 5, 15],
)
def publish_checkpoint(ctx: RunContext, k: int) -> dict[str, Any]:
    out = versions.publish_checkpoint(ctx, k)
    for warning in out.get("warnings") or []:  # a corrupt checkpoint skipped: in the run's log
        get_run_logger().warning("publish_checkpoint: %s", warning)
    return out


@task(
    name="collect_garbage",
    task_run_name="{ctx.run_name}:gc[keep={keep_last}]",
    cache_policy=NO_CACHE,
)
def collect_garbage(ctx: RunContext, keep_last: int) -> dict[str, Any]:
    return ctx.gc(keep_last)
