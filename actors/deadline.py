"""Deadlines on calls that wait for Ray actors, raised as a TimeoutError that
names the actors still owing an answer and the call.

The step tasks run in the flow process, where Prefect's task timeout cannot
interrupt a blocking ``ray.get``: the deadline has to live in the call that
waits. The engine and train groups route every such wait through ``get`` (or
``Deadline`` when one call waits in a loop), with the deadline their owner gave
them (``tasks.timeout_s``). ``None`` waits without limit. No Prefect here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import ray


class CallTimeout(TimeoutError):
    """An actor call passed its deadline; the message names the actors and the call."""


def _message(names: Sequence[str], call: str, timeout_s: float) -> str:
    return (
        f"{', '.join(names)}: {call} did not return within {timeout_s:g}s (the step's "
        "deadline, tasks.timeout_s); the actor may be paused, stuck or starved of its "
        "resources: check it (an engine's /health_generate), or raise tasks.timeout_s"
    )


def get(refs: Any, timeout_s: float | None, call: str, names: str | Sequence[str]) -> Any:
    """``ray.get(refs)`` within ``timeout_s``; CallTimeout naming the actors (``names``,
    one per ref, or one for all) whose answer is missing."""
    single = not isinstance(refs, list)
    lst = [refs] if single else list(refs)
    if timeout_s is not None and lst:
        _, pending = ray.wait(lst, num_returns=len(lst), timeout=timeout_s)
        if pending:
            labels = [names] * len(lst) if isinstance(names, str) else list(names)
            missing = set(pending)
            stuck = sorted({labels[i] for i, r in enumerate(lst) if r in missing})
            raise CallTimeout(_message(stuck, call, timeout_s))
    out = ray.get(lst)
    return out[0] if single else out


class Deadline:
    """One deadline over several waits (a dispatch loop): ``remaining`` for each wait,
    ``expired`` raising CallTimeout once it has passed."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._end = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> float | None:
        return None if self._end is None else max(0.0, self._end - time.monotonic())

    def expired(self, names: Sequence[str], call: str) -> CallTimeout:
        assert self.timeout_s is not None
        return CallTimeout(_message(sorted(set(names)), call, self.timeout_s))
