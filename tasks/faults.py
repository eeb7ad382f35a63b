"""Fault injection for the recovery tests: fail a chosen step at a chosen iteration.

Set by the config's ``faults`` list or by
``PREFECT_RL_FAULT=step:k[:kind[:times]][,step:k...]``. Attempts are counted in
the run's storage, so a fault heals after ``times`` attempts whichever process
retries it, and a rerun of a SIGKILLed run does not fire it again.
"""

from __future__ import annotations

import os
import signal

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
    for fault in active_faults(ctx.cfg.faults):
        if fault.step == step and fault.iteration == k:
            _fire(ctx, fault, kill)


def _fire(ctx, fault: FaultSpec, kill) -> None:
    step, k = fault.step, fault.iteration
    marker = f"{ctx.store.url}/faults/{step}-{k:06d}-{fault.kind}"
    fs = ctx.store.fs
    count = int(fs.cat_file(marker).decode()) if fs.exists(marker) else 0
    if count >= fault.times:
        return
    fs.makedirs(f"{ctx.store.url}/faults", exist_ok=True)
    fs.pipe_file(marker, str(count + 1).encode())
    if fault.kind == "exception":
        raise InjectedFault(
            f"injected fault at {step}[k={k}] (attempt {count + 1} of {fault.times})"
        )
    if fault.kind == "kill_actor":
        if kill is None:
            raise InjectedFault(f"injected fault at {step}[k={k}]: no actor to kill")
        kill()
        return
    os.kill(ctx.driver_pid, signal.SIGKILL)  # kind "sigkill": the flow process dies
    raise InjectedFault("the flow process was SIGKILLed")
