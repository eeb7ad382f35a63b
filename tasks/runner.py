"""The one place a step's cross-cutting concerns are applied.

A step of the iteration is a ``Step`` declaration (``tasks.steps``): its ledger
key, its colocation turn, its fault-injection point and the kill target of that
point, and its phases. ``run`` executes one, in this order, the same for the
Prefect tasks (``flows.step_tasks``) and the plain driver (``flows.driver``):

    1. ledger first   a committed record of (k, key) is returned as it is
                      (``cached: True``); ``audit`` steps (verify) skip this
    2. skip           ``skip(ctx, k)`` may answer without work (not due, done)
    3. turn           colocated: the declared side of the devices awake
                      (``tasks.colocate.TURNS``); not without ``needs(ctx, k)``
    4. ready          brings back the state the work needs (dead actors
                      re-created, trainer state restored); its warnings are kept
    5. turn again     re-created actors start awake: this reads their state back
    6. fault          ``maybe_fail(step.fault, k)``; kind kill_actor kills
                      ``step.kill`` (engine ``engine_id``, or engine 0; train rank 0)
    7. work           the step itself; its dict is the result
    8. commit         result + ``memory`` (device states) + ``warnings``,
                      checked against the step's declared ``result`` model
                      (``tasks.types``), timed, written to ``ledger/iter_k/<key>.json``

The record also holds ``phases``: seconds of turn, ready and work, and of any
named part a work function marks with ``tasks.phases.phase(name)`` (the finish
step's metrics, trackers and retention; a reload's pause, push and continue). They show where a slow step spends its time
without a profiler (``bench/orchestration.py`` prints them per driver).

Nothing here imports Prefect; the Prefect tasks log the returned result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from tasks import colocate
from tasks.faults import kill_engine, kill_train_rank0, maybe_fail
from tasks.phases import phase, step_clock
from tasks.types import StepResult

Result = dict[str, Any]
# ``ready`` returns the warnings it met (e.g. a corrupt checkpoint skipped).
Ready = Callable[[Any, int, "int | None"], list[str]]
Work = Callable[..., Result]


@dataclass(frozen=True)
class Step:
    name: str  # ledger key; a per-engine step's key is f"{name}-e{engine_id}"
    task: str  # Prefect task name (``flows.step_tasks``), shown in the UI
    work: Work  # work(ctx, k, engine_id, **inputs) -> result
    per_engine: bool = False  # mapped: one run per engine id
    fault: str | None = None  # the fault point ``faults: step`` targets; None: no point
    kill: Literal["engine", "train_rank0"] | None = None  # what kind kill_actor kills
    turn: str | None = None  # colocation turn (a key of ``colocate.TURNS``)
    needs: Callable[[Any, int], bool] | None = None  # whether turn/ready/fault apply (None: always)
    ready: Ready | None = None  # bring back the state ``work`` needs
    skip: Callable[[Any, int], Result | None] | None = None  # a result without any work
    audit: bool = False  # True: no ledger-first read, the record is rewritten each pass
    result: type[StepResult] | None = None  # the result's model (tasks.types); None: unchecked

    def key(self, engine_id: int | None = None) -> str:
        """The ledger key (and the last part of the Prefect cache key ``{run}/{k}/{key}``)."""
        if self.per_engine:
            if engine_id is None:
                raise ValueError(f"step {self.name!r} is per engine: pass engine_id")
            return f"{self.name}-e{engine_id}"
        return self.name

    def engine_ids(self, ctx) -> list[int | None]:
        """The ids this step runs for in one iteration ([None] when not per engine)."""
        return list(range(ctx.cfg.engines.num_engines)) if self.per_engine else [None]


def run(ctx, step: Step, k: int, engine_id: int | None = None, **inputs: Any) -> Result:
    """Run ``step`` for iteration k (and engine ``engine_id``): see the module docstring."""
    key = step.key(engine_id)
    if not step.audit:
        record = ctx.store.read_record(k, key)
        if record is not None:
            return {**record["result"], "cached": True, "step_s": record.get("seconds", 0.0)}
    t0 = time.perf_counter()
    with step_clock({}) as phases:
        result = step.skip(ctx, k) if step.skip is not None else None
        if result is None:
            result = _execute(ctx, step, k, engine_id, inputs)
    if step.result is not None:  # the declared shape, or a loud error before the commit
        result = step.result.model_validate(result).model_dump(exclude_unset=True)
    seconds = round(time.perf_counter() - t0, 4)
    ctx.store.write_record(
        k,
        key,
        {
            "run": ctx.run_name,
            "iteration": k,
            "step": key,
            "result": result,
            "seconds": seconds,
            "phases": phases,
            "committed_at": datetime.now(timezone.utc).isoformat(),
        },
        overwrite=step.audit,
    )
    return {**result, "cached": False, "step_s": seconds}


def _execute(ctx, step: Step, k: int, engine_id: int | None, inputs: dict[str, Any]) -> Result:
    memory, warnings = None, []
    if step.needs is None or step.needs(ctx, k):
        if step.turn is not None:
            with phase("turn"):
                memory = colocate.take_turn(ctx, step.turn, engine_id)
        if step.ready is not None:
            with phase("ready"):
                warnings = list(step.ready(ctx, k, engine_id) or [])
            if step.turn is not None:
                with phase("turn"):
                    memory = colocate.take_turn(ctx, step.turn, engine_id)
        if step.fault is not None:
            maybe_fail(ctx, step.fault, k, kill=_kill_target(ctx, step, engine_id))
    with phase("work"):
        result = step.work(ctx, k, engine_id, **inputs)
    warnings += result.pop("warnings", None) or []
    extra: Result = {**colocate.recorded(memory)}
    if warnings:
        extra["warnings"] = warnings
    return {**result, **extra}


def _kill_target(ctx, step: Step, engine_id: int | None) -> Callable[[], None] | None:
    """What fault kind kill_actor kills at this step: the Ray actor the step drives."""
    if step.kill == "engine":
        return lambda: kill_engine(ctx.engines(), 0 if engine_id is None else engine_id)
    if step.kill == "train_rank0":
        return lambda: kill_train_rank0(ctx.trainer())
    return None
