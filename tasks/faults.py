"""Fault injection for the recovery tests: fail a chosen step at a chosen iteration.

Set by the config's ``faults`` list or by
``PREFECT_RL_FAULT=step:k[:kind[:times]][,step:k...]``. Attempts are counted in
the run's storage, so a fault heals after ``times`` attempts whichever process
retries it, and a rerun of a SIGKILLed run does not fire it again. Kind
``kill_actor`` kills the Ray actor a step drives (``kill_engine``,
``kill_train_rank0``), as a real crash would.
"""

from __future__ import annotations

import os
import signal

import ray

from tasks.config import FaultSpec


class InjectedFault(RuntimeError):
    """Raised on purpose by the fault-injection hook."""


def active_faults(configured: list[FaultSpec]) -> list[FaultSpec]:
    spec = os.environ.get("PREFECT_RL_FAULT")
    if not spec:
        return configured
    faults = []
    for item in spec.split(","):
        parts = item.split(":")
        if len(parts) < 2:
            raise ValueError(f"PREFECT_RL_FAULT={spec!r}: expected step:iteration[:kind[:times]]")
        faults.append(
            FaultSpec(
                step=parts[0],
                iteration=int(parts[1]),
                kind=parts[2] if len(parts) > 2 else "exception",
                times=int(parts[3]) if len(parts) > 3 else 1,
            )
        )
    return faults


def maybe_fail(ctx, step: str, k: int, kill=None) -> None:
    """Fail here if a fault targets (step, k) and has attempts left.

    ``kill`` kills the Ray actor behind the step (kind ``kill_actor``); the step
    then runs on and meets the dead actor as it would in a real crash.
    """
    fault = take(ctx, step, k)
    if fault is not None:
        fire(ctx, fault, kill)


def take(ctx, step: str, k: int) -> FaultSpec | None:
    """The fault targeting (step, k) if it has attempts left, its attempt counted
    (in storage, so any process that retries sees it); None otherwise. For a fault
    point inside a step's work, such as a background write (``save_background``)."""
    for fault in active_faults(ctx.cfg.faults):
        if fault.step != step or fault.iteration != k:
            continue
        marker = f"{ctx.store.url}/faults/{step}-{k:06d}-{fault.kind}"
        fs = ctx.store.fs
        count = int(fs.cat_file(marker).decode()) if fs.exists(marker) else 0
        if count >= fault.times:
            continue
        fs.makedirs(f"{ctx.store.url}/faults", exist_ok=True)
        fs.pipe_file(marker, str(count + 1).encode())
        return fault
    return None


def fire(ctx, fault: FaultSpec, kill=None) -> None:
    """Make ``fault`` happen: raise, kill the actor (``kill``), or SIGKILL the flow process."""
    step, k = fault.step, fault.iteration
    if fault.kind == "exception":
        raise InjectedFault(f"injected fault at {step}[k={k}] (up to {fault.times} attempts)")
    if fault.kind == "kill_actor":
        if kill is None:
            raise InjectedFault(f"injected fault at {step}[k={k}]: no actor to kill")
        kill()
        return
    os.kill(ctx.driver_pid, signal.SIGKILL)  # kind "sigkill": the flow process dies
    raise InjectedFault("the flow process was SIGKILLed")


def kill_engine(group, engine_id: int) -> None:
    """Kill engine ``engine_id``'s actor (no restart), if it has one."""
    handle = group.handle(engine_id)
    if handle is not None:
        ray.kill(handle, no_restart=True)


def kill_train_rank0(trainer) -> None:
    """Kill the trainer's rank 0 actor (no restart), if it has ranks."""
    actors = trainer.actors()
    if actors:
        ray.kill(actors[0], no_restart=True)
