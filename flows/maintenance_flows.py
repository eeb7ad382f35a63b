"""Ad-hoc maintenance flows on an existing run: publish a checkpoint as a
version, point the engines at a version (e.g. a rollback) and verify, verify
only, and garbage-collect old versions.

Each takes one pydantic parameters model (a form in the UI). Bad input (an
unknown run, a version or checkpoint that is not committed) is refused before
any work starts, with a message that names the fix.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, unmapped
from pydantic import BaseModel, ConfigDict, Field

from flows.config import RunConfig
from storage.config import S3Options, StorageConfig
from storage.run_store import RunStore
from tasks import maintenance
from tasks.context import RunContext
from tasks.lease import LeaseKeeper
from tasks.prepare import check_run, connect_ray, take_lease


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


def open_run(ref: RunRef, writer: bool) -> RunContext:
    """The RunContext of an existing run, from its run.json; refuses unknown runs."""
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
    ctx = RunContext(cfg=cfg, base_model_path=check_run(cfg))
    if writer:
        ctx = take_lease(ctx, wait=False)
    connect_ray(cfg)
    return ctx


def _committed_version(ctx: RunContext, version: int) -> None:
    versions = ctx.store.committed_versions()
    if version not in versions:
        raise ValueError(
            f"version {version} of run {ctx.run_name!r} is not committed; committed: {versions}"
        )


def _point_and_check(ctx: RunContext, version: int) -> list[dict[str, Any]]:
    engines = list(range(ctx.cfg.engines.num_engines))
    points = maintenance.point_engine.map(unmapped(ctx), version, engines)
    checks = maintenance.check_engine.map(unmapped(ctx), version, engines, upstream=points)
    return [c.result() for c in checks]


# No RayTaskRunner here: entered before the flow body, it would start (or join)
# a Ray cluster of its own choosing, listening on all interfaces, before
# open_run connects to the run's cluster (its ray.address, or a loopback-only
# local one). These tasks only call engines; threads of this process suffice.


@flow(
    name="publish-weights",
    flow_run_name="{params.run_name}:publish-checkpoint[k={params.checkpoint}]",
)
def publish_weights_flow(params: PublishParams) -> dict[str, Any]:
    ctx = open_run(params, writer=True)
    if params.checkpoint not in ctx.store.committed_checkpoints():
        raise ValueError(
            f"checkpoint {params.checkpoint} of run {params.run_name!r} is not committed; "
            f"committed: {ctx.store.committed_checkpoints()}"
        )
    with LeaseKeeper(ctx):
        return maintenance.publish_checkpoint(ctx, params.checkpoint)


@flow(name="reload-engines", flow_run_name="{params.run_name}:reload[v={params.version}]")
def reload_engines_flow(params: ReloadParams) -> list[dict[str, Any]]:
    ctx = open_run(params, writer=True)
    _committed_version(ctx, params.version)
    with LeaseKeeper(ctx):
        return _point_and_check(ctx, params.version)


@flow(name="verify-engines", flow_run_name="{params.run_name}:verify")
def verify_engines_flow(params: RunRef) -> list[dict[str, Any]]:
    ctx = open_run(params, writer=False)
    serving = ctx.store.serving_versions()
    engines = list(range(ctx.cfg.engines.num_engines))
    missing = [e for e in engines if e not in serving]
    if missing:
        raise ValueError(
            f"engines {missing} of run {params.run_name!r} have no recorded version; run reload-engines first"
        )
    checks = [maintenance.check_engine.submit(ctx, serving[e], e) for e in engines]
    return [c.result() for c in checks]


@flow(name="gc-versions", flow_run_name="{params.run_name}:gc[keep={params.keep_last}]")
def gc_versions_flow(params: GcParams) -> dict[str, Any]:
    ctx = open_run(params, writer=True)
    with LeaseKeeper(ctx):
        return maintenance.collect_garbage(ctx, params.keep_last)
