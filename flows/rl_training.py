"""``rl_training``: the whole run as a Prefect flow of ``rl_iteration`` subflows.

It prepares the run (lease, run.json, v0), finds the resume point in the
ledger, and runs the remaining iterations on prefect-ray's RayTaskRunner.
A finished run reports that it is complete and does nothing.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect_ray import RayTaskRunner
from pydantic import BaseModel, ConfigDict, Field

from flows import artifacts
from flows.config import RunConfig, load_config
from flows.iteration import rl_iteration
from flows.progress import iteration_line, summary
from tasks import steps
from tasks.lease import LeaseKeeper
from tasks.prepare import prepare_run


class TrainingParams(BaseModel):
    """Parameters of ``rl-training`` (rendered as a form in the Prefect UI)."""

    model_config = ConfigDict(extra="forbid")

    config_path: str = Field(
        "configs/tiny-cpu.yaml", title="Config file", description="YAML run config"
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        title="Overrides",
        description='Dotted keys, e.g. {"run.iterations": 30, "run.name": "exp1"}',
    )
    extra_iterations: int | None = Field(
        None,
        ge=1,
        le=100000,
        title="Continue by N iterations",
        description="Run N iterations past the last committed one (the nightly deployment uses this)",
    )
    force_lease: bool = Field(
        False, title="Take over the lease", description="Only when the holder is dead"
    )


def _run_name() -> str:
    """Flow run name ``<run>:training``, read from the parameters being run."""
    from prefect.runtime import flow_run

    params = flow_run.parameters.get("params") or {}
    if isinstance(params, BaseModel):
        params = params.model_dump()
    overrides = params.get("overrides") or {}
    name = overrides.get("run.name")
    if name is None:
        try:
            name = load_config(params.get("config_path", "configs/tiny-cpu.yaml")).run.name
        except ValueError:
            name = "invalid-config"
    return f"{name}:training"


def _tag_flow_run(run_name: str) -> None:
    """Tag this flow run with the run name, so the UI can filter a run's history."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    with get_client(sync_client=True) as client:
        current = client.read_flow_run(flow_run.id)
        if run_name not in current.tags:
            client.update_flow_run(flow_run.id, tags=[*current.tags, run_name])


@flow(name="rl-training", flow_run_name=_run_name, log_prints=True)
def rl_training(params: TrainingParams | None = None) -> dict[str, Any]:
    params = params or TrainingParams()
    logger = get_run_logger()
    cfg = load_config(params.config_path, params.overrides)
    _tag_flow_run(cfg.run.name)
    if params.extra_iterations:
        cfg = continued(cfg, params.extra_iterations)
    ctx = prepare_run(cfg, force_lease=params.force_lease)
    start = steps.first_unfinished(ctx)
    total = cfg.run.iterations
    rows: list[dict[str, Any]] = []
    seconds: list[float] = []
    t0 = time.perf_counter()
    with LeaseKeeper(ctx) as keeper:
        if start > total:
            logger.info("run %r is complete (%d iterations); nothing to do", cfg.run.name, total)
        else:
            logger.info(
                "run %r: iterations %d..%d (store %s)", cfg.run.name, start, total, ctx.store.url
            )
        iteration = rl_iteration.with_options(task_runner=RayTaskRunner(address=cfg.ray.address))
        progress = artifacts.start_progress(cfg.run.name, start - 1, total)
        step_seconds: dict[str, float] = {}
        for k in range(start, total + 1):
            keeper.check()  # another writer took the run over: stop before the next iteration
            t_iter = time.perf_counter()
            out = iteration(ctx, k)
            seconds.append(time.perf_counter() - t_iter)
            rows.append(out["row"])
            add_step_seconds(ctx, step_seconds, out)
            print(iteration_line(out["row"], total))
            artifacts.update_progress(progress, k, total)
        artifacts.run_summary(ctx, rows, step_seconds)
        if rows:
            # The trainer's devices are freed. Engines stay up on a persistent
            # cluster (they serve the final version); a local one ends with us.
            ctx.trainer().shutdown()
            if cfg.ray.address is None:
                ctx.engines().shutdown()
    text = summary(rows, ctx.store.url, ctx.store.committed_versions(), time.perf_counter() - t0)
    print(text)
    return {
        "run": cfg.run.name,
        "iterations": [r["iteration"] for r in rows],
        "seconds": seconds,
        "summary": text,
    }


def add_step_seconds(ctx, totals: dict[str, float], out: dict[str, Any]) -> None:
    """Add one iteration's step times (per-engine steps summed) to ``totals``."""
    for step in steps.ITERATION:
        for e in step.engine_ids(ctx):
            result = out[step.key(e)]
            if "step_s" in result:
                totals[step.name] = totals.get(step.name, 0.0) + result["step_s"]


def continued(cfg: RunConfig, extra: int) -> RunConfig:
    """The config with run.iterations set to (last committed iteration + extra)."""
    from storage.run_store import RunStore

    store = RunStore(cfg.storage, cfg.run.name)
    done = max((m["iteration"] for m in store.read_metrics()), default=0)
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"iterations": done + extra})})
