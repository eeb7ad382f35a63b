"""Seconds of the named parts of the running step (its ledger record's ``phases``).

``tasks.runner`` opens a step's clock (``step_clock``) around each step; a work
function, or anything it calls on the same thread (``tasks.serving``' reload:
pause, push, continue), marks a part with ``phase(name)``. Outside a step the
marks cost a clock read and record nothing. A leaf of ``tasks``: it imports
nothing of the package, so the modules below the runner can mark their parts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar

# The phases of the step running on this thread: ``step_clock`` sets it for the step's
# duration and resets it after, so steps on other threads never see each other's.
_PHASES: ContextVar[dict[str, float] | None] = ContextVar("step_phases", default=None)


@contextlib.contextmanager
def step_clock(phases: dict[str, float]) -> Iterator[dict[str, float]]:
    """Collect the ``phase`` marks of this thread into ``phases`` for the block."""
    token = _PHASES.set(phases)
    try:
        yield phases
    finally:
        _PHASES.reset(token)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the seconds of the block to the running step's ``phases`` under ``name``
    (nothing outside a step)."""
    phases = _PHASES.get()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if phases is not None:
            phases[name] = round(phases.get(name, 0.0) + time.perf_counter() - t0, 4)
