"""The Prefect task of each step, generated from its declaration (``tasks.steps``).

A step's task is ``tasks.runner.run`` of its ``Step``, named after it: the task
is ``Step.task`` (``save_checkpoint``), its runs ``<run>:save[k=3]`` or
``<run>:reload[k=3,engine=1]``. Its parameters are ``ctx`` and ``k``,
``engine_id`` for a per-engine step, and whatever else the step's work takes
(finish: ``results``). Cache keys are the ledger identity ``{run}/{k}/{step}``
and results are persisted under the run root, so a retried flow run shows
finished steps as Cached; an audit step (verify) is never cached. Correctness
does not depend on that: each step reads the ledger first. Retries, delays and
result storage come from the config (``RunContext.cfg.tasks``) and are applied
by the flow with ``with_options`` (``flows.iteration``).
"""

from __future__ import annotations

import inspect
from typing import Any

from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks import runner, steps
from tasks.context import RunContext
from tasks.runner import Step

Result = dict[str, Any]

# A task run is named after its step's ledger key, but the iteration's commit (its
# record is ``iteration``) reads as the plan draws it: ``finish[k=3]``.
_SHOWN = {steps.FINISH.name: "finish"}


def _logged(name: str, result: Result) -> Result:
    """Log the step's summary to the task run's log (shown in the UI), and each
    of its ``warnings`` (e.g. a corrupt checkpoint skipped in a Ray worker) as a
    warning there, where a user looks."""
    logger = get_run_logger()
    for warning in result.get("warnings") or []:
        logger.warning("%s: %s", name, warning)
    shown = {
        k: (round(v, 4) if isinstance(v, float) else v)
        for k, v in result.items()
        if k not in ("example", "warnings")
    }
    logger.info("%s: %s", name, shown)
    return result


def _ledger_key(step: Step):
    def key(_context, parameters: dict[str, Any]) -> str:
        ctx: RunContext = parameters["ctx"]
        return f"{ctx.run_name}/{parameters['k']}/{step.key(parameters.get('engine_id'))}"

    return key


def _parameters(step: Step) -> inspect.Signature:
    """``ctx``, ``k``, ``engine_id`` (per-engine steps) and the inputs the work takes
    after its own ``(ctx, k, engine_id)``: what Prefect shows and binds."""
    given = inspect.Parameter.POSITIONAL_OR_KEYWORD
    names = ["ctx", "k", *(["engine_id"] if step.per_engine else [])]
    names += list(inspect.signature(step.work).parameters)[3:]
    return inspect.Signature([inspect.Parameter(n, given) for n in names])


def step_task(step: Step) -> Task:
    """The Prefect task that runs ``step`` (see the module docstring)."""
    signature = _parameters(step)

    def run_step(*args: Any, **kwargs: Any) -> Result:
        given = signature.bind(*args, **kwargs).arguments
        ctx, k, engine_id = given.pop("ctx"), given.pop("k"), given.pop("engine_id", None)
        return _logged(step.task, runner.run(ctx, step, k, engine_id, **given))

    run_step.__signature__ = signature  # what Prefect reads: inspect.signature
    run_step.__name__ = run_step.__qualname__ = step.task  # Prefect's task key
    engine = ",engine={engine_id}" if step.per_engine else ""
    # An audit step (verify) is never cached: it must look at what the engines serve
    # now (its ledger record is rewritten on each pass).
    cache = {"cache_policy": NO_CACHE} if step.audit else {"cache_key_fn": _ledger_key(step)}
    return task(
        run_step,
        name=step.task,
        task_run_name=f"{{ctx.run_name}}:{_SHOWN.get(step.name, step.name)}[k={{k}}{engine}]",
        **cache,
    )


# Each declaration's Prefect task, by ledger key: ``flows.iteration`` starts the
# plan's nodes through it.
TASKS: dict[str, Task] = {s.name: step_task(s) for s in (*steps.STEPS, steps.FINISH)}
