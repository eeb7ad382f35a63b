"""``rl_training``: the whole run as one Prefect flow run of step task runs.

It prepares the run (lease, run.json, v0), finds the resume point in the
ledger, and runs the remaining iterations (``flows.iteration``), each step a
task run on the flow's thread pool. A finished run reports that it is
complete, says how to continue it, and does nothing.
"""

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import BaseModel, ConfigDict, Field

from flows import artifacts
from flows.config import RunConfig, load_config
from flows.console import one_line_failures
from flows.iteration import run_iteration
from flows.params import takes
from flows.progress import iteration_line, summary
from flows.run_tags import tag_flow_run
from storage.run_store import RunStore
from tasks import plan, steps, tracking
from tasks.lease import LeaseKeeper
from tasks.prepare import prepare_run

DEFAULT_CONFIG = "configs/tiny-cpu.yaml"


class TrainingParams(BaseModel):
    """Parameters of ``rl-training``: top-level flow parameters (``flows.params.takes``),
    e.g. ``prefect deployment run 'rl-training/tiny-cpu' --param extra_iterations=2``,
    rendered as the UI form."""

    model_config = ConfigDict(extra="forbid")

    config_path: str = Field(DEFAULT_CONFIG, title="Config file", description="YAML run config")
    overrides: dict[str, Any] = Field(
        {},  # a plain default: flow parameters cannot carry a default_factory
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

    params = flow_run.parameters
    name = (params.get("overrides") or {}).get("run.name")
    if name is None:
        try:
            name = load_config(params.get("config_path", DEFAULT_CONFIG)).run.name
        except ValueError:
            name = "invalid-config"
    return f"{name}:training"


@flow(
    name="rl-training",
    flow_run_name=_run_name,
    log_prints=True,
    # Steps drive Ray actors from the flow process (the Ray driver): threads, not Ray tasks.
    task_runner=ThreadPoolTaskRunner(max_workers=32),
)
@takes(TrainingParams)
def rl_training(params: TrainingParams) -> dict[str, Any]:
    one_line_failures()
    logger = get_run_logger()
    cfg = load_config(params.config_path, params.overrides)
    tag_flow_run(cfg.run.name)
    if params.extra_iterations:
        cfg = continued(cfg, params.extra_iterations)
    total = cfg.run.iterations
    store = RunStore(cfg.storage, cfg.run.name)
    if steps.first_unfinished(store, total) > total:
        # Nothing to run: answer before the lease, Ray or any actor.
        done = steps.first_unfinished(store, 10**9) - 1
        logger.info(
            "run %r is complete: %d iterations committed (run.iterations=%d); nothing to do. "
            "To continue it, raise run.iterations (overrides {'run.iterations': %d}) or pass "
            "extra_iterations",
            cfg.run.name,
            done,
            total,
            done + 10,
        )
        return {"run": cfg.run.name, "iterations": [], "seconds": [], "summary": "complete"}
    ctx = prepare_run(cfg, force_lease=params.force_lease)
    start = steps.first_unfinished(ctx.store, total)
    rows: list[dict[str, Any]] = []
    seconds: list[float] = []
    t0 = time.perf_counter()
    with LeaseKeeper(ctx) as keeper:
        logger.info(
            "run %r: iterations %d..%d (store %s)", cfg.run.name, start, total, ctx.store.url
        )
        progress = artifacts.start_progress(cfg.run.name, start - 1, total)
        step_seconds: dict[str, float] = {}
        ahead = steps.build_trainer_ahead(ctx, start)  # beside the engines' start
        with artifacts.Reporter() as report:
            try:
                for k in range(start, total + 1):
                    keeper.check()  # another writer took the run over: stop before the next one
                    t_iter = time.perf_counter()
                    out = run_iteration(ctx, k)
                    seconds.append(time.perf_counter() - t_iter)
                    rows.append(out["row"])
                    add_step_seconds(ctx, k, step_seconds, out)
                    print(iteration_line(out["row"], total))
                    report.submit(artifacts.iteration_table, cfg.run.name, k, out["row"])
                    report.submit(artifacts.update_progress, progress, k, total)
            finally:
                if ahead is not None:
                    ahead.join()  # no build left running behind a failed flow run
                tracking.close()
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


def add_step_seconds(ctx, k: int, totals: dict[str, float], out: dict[str, Any]) -> None:
    """Add iteration k's step times (per-engine steps summed, by step name) to ``totals``."""
    for node in plan.iteration_plan(ctx, k):
        result = out.get(node.id) or {}
        if "step_s" in result:
            totals[node.step.name] = totals.get(node.step.name, 0.0) + result["step_s"]


def continued(cfg: RunConfig, extra: int) -> RunConfig:
    """The config with run.iterations set to (last committed iteration + extra)."""
    store = RunStore(cfg.storage, cfg.run.name)
    done = max((m["iteration"] for m in store.read_metrics()), default=0)
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"iterations": done + extra})})
