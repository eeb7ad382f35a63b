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

from flows.config import load_config
from flows.iteration import rl_iteration
from flows.progress import iteration_line, summary
from tasks import steps
from tasks.lease import LeaseKeeper
from tasks.prepare import prepare_run


class TrainingParams(BaseModel):
    """Parameters of ``rl-training`` (rendered as a form in the Prefect UI)."""

    model_config = ConfigDict(extra="forbid")

    config_path: str = Field("configs/tiny-cpu.yaml", title="Config file", description="YAML run config")
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        title="Overrides",
        description='Dotted keys, e.g. {"run.iterations": 30, "run.name": "exp1"}',
    )
    force_lease: bool = Field(False, title="Take over the lease", description="Only when the holder is dead")


@flow(name="rl-training", log_prints=True)
def rl_training(params: TrainingParams | None = None) -> dict[str, Any]:
    params = params or TrainingParams()
    logger = get_run_logger()
    cfg = load_config(params.config_path, params.overrides)
    ctx = prepare_run(cfg, force_lease=params.force_lease)
    start = steps.first_unfinished(ctx)
    total = cfg.run.iterations
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with LeaseKeeper(ctx):
        if start > total:
            logger.info("run %r is complete (%d iterations); nothing to do", cfg.run.name, total)
        else:
            logger.info("run %r: iterations %d..%d (store %s)", cfg.run.name, start, total, ctx.store.url)
        iteration = rl_iteration.with_options(task_runner=RayTaskRunner(address=cfg.ray.address))
        for k in range(start, total + 1):
            out = iteration(ctx, k)
            rows.append(out["row"])
            print(iteration_line(out["row"], total))
        if rows:
            ctx.engines().shutdown()
            ctx.trainer().shutdown()
    text = summary(rows, ctx.store.url, ctx.store.committed_versions(), time.perf_counter() - t0)
    print(text)
    return {"run": cfg.run.name, "iterations": [r["iteration"] for r in rows], "summary": text}
