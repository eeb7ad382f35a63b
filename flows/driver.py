"""The plain-Python driver: the same steps as the Prefect flows, in a loop.

It proves the runtime below ``flows/`` and ``tasks/`` needs no Prefect, and it
is the baseline of ``bench/orchestration.py``. It has no retries and no UI.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flows.config import RunConfig
from flows.progress import iteration_line
from tasks import plan, runner, steps, tracking
from tasks.context import RunContext
from tasks.lease import LeaseKeeper
from tasks.prepare import prepare_run


def run_iteration(ctx: RunContext, k: int) -> dict[str, Any]:
    """Walk iteration k's plan on threads, as the flow does on its task runner
    (a node starts once what it waits for succeeded); returns the metrics row."""

    def start(node: plan.Node, done: dict[str, Any]):
        inputs = plan.node_inputs(node, done)
        return pool.submit(runner.run, ctx, node.step, node.k, node.engine_id, **inputs)

    nodes = plan.iteration_plan(ctx, k)
    with ThreadPoolExecutor(max_workers=len(nodes), thread_name_prefix=f"iter{k}") as pool:
        results = plan.walk(nodes, start)
    return results[f"{steps.FINISH.key()}@{k}"]


def run_plain(
    cfg: RunConfig, quiet: bool = False, keep_actors: bool = False
) -> tuple[RunContext, list[dict[str, Any]], float]:
    """Run the remaining iterations. At the end the actors are shut down, as
    ``rl_training`` does (engines stay up on a persistent cluster), unless
    ``keep_actors``."""
    ctx = prepare_run(cfg)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with LeaseKeeper(ctx) as keeper:
        first = steps.first_unfinished(ctx.store, cfg.run.iterations)
        ahead = steps.build_trainer_ahead(ctx, first)  # beside the engines' start
        try:
            for k in range(first, cfg.run.iterations + 1):
                keeper.check()
                rows.append(run_iteration(ctx, k))
                if not quiet:
                    print(iteration_line(rows[-1], cfg.run.iterations), flush=True)
        finally:
            if ahead is not None:
                ahead.join()  # no build left running behind a failed run
            tracking.close()
    if not keep_actors:
        ctx.trainer().shutdown()
        if cfg.ray.address is None:
            ctx.engines().shutdown()
    return ctx, rows, time.perf_counter() - t0
