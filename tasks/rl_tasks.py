"""Prefect tasks: one per step, named with verbs, each ``tasks.runner.run`` of
its declaration in ``tasks/steps.py`` (``TASKS`` maps a declaration to its task).

Cache keys are the ledger identity ``{run}/{k}/{step}`` and results are
persisted under the run root, so a retried flow run shows finished steps as
Cached. Correctness does not depend on that: each step reads the ledger first.
Retries, delays and timeouts come from the config (``RunContext.cfg.tasks``)
and are applied by the flow with ``with_options``.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks import runner, steps
from tasks.context import RunContext

# The flow starts a task only once what it waits for has succeeded
# (``tasks.plan.walk``), so tasks take no upstream futures.


def _logged(step: str, result: dict[str, Any]) -> dict[str, Any]:
    """Log the step's summary to the task run's log (shown in the UI), and each
    of its ``warnings`` (e.g. a corrupt checkpoint skipped in a Ray worker) as a
    warning there, where a user looks."""
    logger = get_run_logger()
    for warning in result.get("warnings") or []:
        logger.warning("%s: %s", step, warning)
    shown = {
        k: (round(v, 4) if isinstance(v, float) else v)
        for k, v in result.items()
        if k not in ("example", "warnings")
    }
    logger.info("%s: %s", step, shown)
    return result


def _ledger_key(step: runner.Step):
    def key(_context, parameters: dict[str, Any]) -> str:
        ctx: RunContext = parameters["ctx"]
        return f"{ctx.run_name}/{parameters['k']}/{step.key(parameters.get('engine_id'))}"

    return key


@task(
    name="rollout",
    task_run_name="{ctx.run_name}:rollout[k={k}]",
    cache_key_fn=_ledger_key(steps.ROLLOUT),
)
def rollout(ctx: RunContext, k: int) -> dict[str, Any]:
    return _logged("rollout", runner.run(ctx, steps.ROLLOUT, k))


@task(
    name="rollout_head",
    task_run_name="{ctx.run_name}:rollout_head[k={k}]",
    cache_key_fn=_ledger_key(steps.ROLLOUT_HEAD),
)
def rollout_head(ctx: RunContext, k: int) -> dict[str, Any]:
    return _logged("rollout_head", runner.run(ctx, steps.ROLLOUT_HEAD, k))


@task(
    name="train", task_run_name="{ctx.run_name}:train[k={k}]", cache_key_fn=_ledger_key(steps.TRAIN)
)
def train(ctx: RunContext, k: int) -> dict[str, Any]:
    return _logged("train", runner.run(ctx, steps.TRAIN, k))


@task(
    name="save_checkpoint",
    task_run_name="{ctx.run_name}:save[k={k}]",
    cache_key_fn=_ledger_key(steps.SAVE),
)
def save_checkpoint(ctx: RunContext, k: int) -> dict[str, Any]:
    return _logged("save_checkpoint", runner.run(ctx, steps.SAVE, k))


@task(
    name="publish_weights",
    task_run_name="{ctx.run_name}:publish[k={k}]",
    cache_key_fn=_ledger_key(steps.PUBLISH),
)
def publish_weights(ctx: RunContext, k: int) -> dict[str, Any]:
    return _logged("publish_weights", runner.run(ctx, steps.PUBLISH, k))


@task(
    name="reload_engine",
    task_run_name="{ctx.run_name}:reload[k={k},engine={engine_id}]",
    cache_key_fn=_ledger_key(steps.RELOAD),
)
def reload_engine(ctx: RunContext, k: int, engine_id: int) -> dict[str, Any]:
    return _logged("reload_engine", runner.run(ctx, steps.RELOAD, k, engine_id))


# Verify is never cached: it must look at what the engines serve now (its
# ledger record is an audit, rewritten on each pass).
@task(
    name="verify_engine",
    task_run_name="{ctx.run_name}:verify[k={k},engine={engine_id}]",
    cache_policy=NO_CACHE,
)
def verify_engine(ctx: RunContext, k: int, engine_id: int) -> dict[str, Any]:
    return _logged("verify_engine", runner.run(ctx, steps.VERIFY, k, engine_id))


@task(
    name="evaluate",
    task_run_name="{ctx.run_name}:evaluate[k={k}]",
    cache_key_fn=_ledger_key(steps.EVALUATE),
)
def evaluate(ctx: RunContext, k: int) -> dict[str, Any]:
    return _logged("evaluate", runner.run(ctx, steps.EVALUATE, k))


@task(
    name="finish_iteration",
    task_run_name="{ctx.run_name}:finish[k={k}]",
    cache_key_fn=_ledger_key(steps.FINISH),
)
def finish_iteration(ctx: RunContext, k: int, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return _logged("finish_iteration", runner.run(ctx, steps.FINISH, k, results=results))


# Each declaration's Prefect task: ``flows.iteration`` starts the plan's nodes through it.
TASKS = {
    steps.ROLLOUT.name: rollout,
    steps.ROLLOUT_HEAD.name: rollout_head,
    steps.TRAIN.name: train,
    steps.SAVE.name: save_checkpoint,
    steps.PUBLISH.name: publish_weights,
    steps.RELOAD.name: reload_engine,
    steps.VERIFY.name: verify_engine,
    steps.EVALUATE.name: evaluate,
    steps.FINISH.name: finish_iteration,
}
