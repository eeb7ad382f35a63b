"""Ad-hoc maintenance flows on an existing run: publish a checkpoint as a
version, point the engines at a version (e.g. a rollback) and verify, verify
only, and garbage-collect old versions.

Each flow's parameters are one pydantic model, exposed as top-level parameters
(``--param version=3``; ``flows.params.takes``). Every flow run is tagged with
the run name. The order is always the same:

    validate   the run exists, its config and storage root pass, the version or
               checkpoint asked for is committed, a Ray cluster at ray.address
               answers: a refusal names the fix, and nothing has started
    lease      writers only (verify-engines reads); refused at once while a live
               holder has it, released however the flow ends
    Ray        the run's cluster (ray.address) or a new local one (tasks.cluster)
    work       mapped per engine like the iteration's reload and verify; what was
               done (published, deleted, kept and why) goes to the flow run's log
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect import flow, get_run_logger, unmapped
from pydantic import BaseModel, ConfigDict, Field

from flows import maintenance_tasks
from flows.config import RunConfig
from flows.params import takes
from flows.run_tags import tag_flow_run
from storage.config import S3Options, StorageConfig
from storage.run_store import RunStore
from tasks.context import RunContext
from tasks.lease import LeaseKeeper
from tasks.prepare import check_run, connect_ray, take_lease

LOCAL_ENGINES = (
    "run {run!r} uses a local Ray cluster (no ray.address): its engines end with the flow "
    "run that started them. To keep engines alive between flow runs, start a persistent "
    "cluster (ray start --head --port=6379 --num-cpus=8) and run with "
    "ray.address=127.0.0.1:6379 (docs/prefect.md, A persistent Ray cluster)"
)


class RunRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_name: str = Field("tiny-cpu", title="Run name", min_length=1, max_length=64)
    storage_root: str = Field(
        "runs", title="Storage root", description="Path or URL, as in storage.root"
    )
    s3_endpoint_url: str | None = Field(None, title="S3 endpoint URL (optional)")


class PublishParams(RunRef):
    checkpoint: int = Field(..., ge=0, title="Checkpoint iteration to publish")


class ReloadParams(RunRef):
    version: int = Field(..., ge=0, title="Weights version to serve")


class GcParams(RunRef):
    keep_last: int = Field(3, ge=1, le=10000, title="Versions and checkpoints to keep")


def open_run(ref: RunRef) -> RunContext:
    """The RunContext of an existing run, from its run.json, checked as a training
    run is checked (``check_run``, less the datasets and trackers no maintenance
    flow reads); nothing is started and no lease is taken."""
    tag_flow_run(ref.run_name)
    storage = StorageConfig(root=ref.storage_root, s3=S3Options(endpoint_url=ref.s3_endpoint_url))
    store = RunStore(storage, ref.run_name)
    snapshot = store.read_run_json()
    if snapshot is None:
        raise ValueError(
            f"no run {ref.run_name!r} under {store.url} (no run.json); check run_name and storage_root"
        )
    data = snapshot["config"]
    data["storage"] = {**data["storage"], "root": ref.storage_root}
    if ref.s3_endpoint_url:
        data["storage"].setdefault("s3", {})["endpoint_url"] = ref.s3_endpoint_url
    cfg = RunConfig.model_validate(data)
    return RunContext(cfg=cfg, base_model_path=check_run(cfg, inputs=False))


@contextmanager
def writing(ctx: RunContext) -> Iterator[RunContext]:
    """Hold the run's lease (refused at once if a live holder has it) and its Ray
    connection; the lease is released however the block ends."""
    ctx = take_lease(ctx, wait=False)
    with LeaseKeeper(ctx):  # its exit releases the lease, on success or failure
        connect_ray(ctx.cfg)
        yield ctx


def require_committed(ctx: RunContext, what: str, k: int, committed: list[int]) -> None:
    if k not in committed:
        raise ValueError(
            f"{what} {k} of run {ctx.run_name!r} is not committed; committed: {committed}"
        )


def engine_ids(ctx: RunContext) -> list[int]:
    return list(range(ctx.cfg.engines.num_engines))


@flow(
    name="publish-weights",
    flow_run_name="{run_name}:publish-checkpoint[k={checkpoint}]",
)
@takes(PublishParams)
def publish_weights_flow(params: PublishParams) -> dict[str, Any]:
    log = get_run_logger()
    ctx = open_run(params)
    k = params.checkpoint
    if k in ctx.store.committed_versions():
        log.info(
            "v%d of run %r is already published (%s); nothing to do",
            k,
            ctx.run_name,
            ctx.store.version_url(k),
        )
        return {"version": k, "url": ctx.store.version_url(k), "published": False}
    require_committed(ctx, "checkpoint", k, ctx.store.committed_checkpoints())
    with writing(ctx) as ctx:
        out = maintenance_tasks.publish_checkpoint(ctx, k)
    log.info(
        "published checkpoint %d of run %r as v%d: %s (%d files)",
        k,
        ctx.run_name,
        k,
        out["url"],
        out["files"],
    )
    return out


@flow(name="reload-engines", flow_run_name="{run_name}:reload[v={version}]")
@takes(ReloadParams)
def reload_engines_flow(params: ReloadParams) -> list[dict[str, Any]]:
    log = get_run_logger()
    ctx = open_run(params)
    v = params.version
    require_committed(ctx, "version", v, ctx.store.committed_versions())
    before = ctx.store.serving_versions()
    with writing(ctx) as ctx:
        engines = engine_ids(ctx)
        points = maintenance_tasks.point_engine.map(unmapped(ctx), v, engines)
        checks = maintenance_tasks.check_engine.map(unmapped(ctx), v, engines, upstream=points)
        results = [c.result() for c in checks]
    for e in engines:
        log.info("engine %d of run %r serves v%d (was %s)", e, ctx.run_name, v, _v(before.get(e)))
    if ctx.cfg.ray.address is None:
        log.warning(
            "%s; the next training run starts its engines on the newest committed version",
            LOCAL_ENGINES.format(run=ctx.run_name),
        )
    return results


@flow(name="verify-engines", flow_run_name="{run_name}:verify")
@takes(RunRef)
def verify_engines_flow(params: RunRef) -> list[dict[str, Any]]:
    log = get_run_logger()
    ctx = open_run(params)
    serving = ctx.store.serving_versions()
    missing = [e for e in engine_ids(ctx) if e not in serving]
    if missing:
        raise ValueError(
            f"engines {missing} of run {params.run_name!r} have no recorded version; "
            "run reload-engines first"
        )
    # Read-only: no lease. The check writes nothing (no audit record without a lease).
    connect_ray(ctx.cfg)
    if ctx.cfg.ray.address is None:
        log.warning(
            "%s. No engine was live: starting each on its recorded version to verify that "
            "it loads and serves it",
            LOCAL_ENGINES.format(run=ctx.run_name),
        )
        started = [
            maintenance_tasks.start_engine.submit(ctx, serving[e], e) for e in engine_ids(ctx)
        ]
        [s.result() for s in started]
    checks = [maintenance_tasks.check_engine.submit(ctx, serving[e], e) for e in engine_ids(ctx)]
    results = [c.result() for c in checks]
    for e in engine_ids(ctx):
        log.info("engine %d of run %r serves v%d, as recorded", e, ctx.run_name, serving[e])
    return results


@flow(name="gc-versions", flow_run_name="{run_name}:gc[keep={keep_last}]")
@takes(GcParams)
def gc_versions_flow(params: GcParams) -> dict[str, Any]:
    log = get_run_logger()
    ctx = open_run(params)
    with writing(ctx) as ctx:
        report = maintenance_tasks.collect_garbage(ctx, params.keep_last)
    log.info(
        "run %r, keep_last=%d: deleted versions %s and checkpoints %s; kept versions %s and "
        "checkpoints %s",
        ctx.run_name,
        params.keep_last,
        report["deleted_versions"],
        report["deleted_checkpoints"],
        report["kept_versions"],
        report["kept_checkpoints"],
    )
    for v, why in sorted(report["protected"].items()):
        log.info("kept v%s beyond keep_last: %s", v, why)
    if report["removed_debris"]:
        log.info("removed unfinished writes: %s", report["removed_debris"])
    if "critic" in report:  # PPO: the critic's checkpoints follow the same keep_last
        critic = report["critic"]
        log.info(
            "PPO critic: deleted checkpoints %s; kept checkpoints %s",
            critic["deleted_checkpoints"],
            critic["kept_checkpoints"],
        )
    return report


def _v(version: int | None) -> str:
    return "nothing recorded" if version is None else f"v{version}"
