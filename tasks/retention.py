"""Retention (``storage.keep_last``) off the critical path: one background pass at a time.

Deleting old versions and checkpoints is bound by the disk or the object store,
and nothing in the next iteration needs it done. On the H200 machine at the 0.5B
shape a pass (a 1 GB version, and a 2.3 GB checkpoint when every iteration saves)
took 0.3-1.5 s, all of it inside the finish step, on the critical path of every
iteration (``bench/pipeline.py`` prints the finish step's phases).

So the finish step of iteration k starts a pass on a thread of the driver
process and returns. Passes run one at a time and in order: starting one first
waits for the one before. Only the lease holder may delete, so the lease is
released only after the last pass has ended (``tasks.lease.LeaseKeeper`` waits
for it). A pass that fails loses nothing (a version is uncommitted before it is
removed; leftovers are removed by the next pass as debris); its error comes back
as a warning of the next finish step, and the next pass tries again. A killed
process leaves at most one half-deleted, uncommitted folder, as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("prefect_rl.retention")


class _Pass:
    """One retention pass on its own thread; its error kept for whoever waits for it."""

    def __init__(self, run: Callable[[], object]) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._body, args=(run,), name="retention")
        self._thread.daemon = True  # a killed run must not hang on it; see the module doc
        self._thread.start()

    def _body(self, run: Callable[[], object]) -> None:
        try:
            run()
        except BaseException as e:  # noqa: BLE001 - handed to the waiter as a warning
            self.error = e

    def wait(self) -> list[str]:
        self._thread.join()
        if self.error is None:
            return []
        msg = (
            f"retention (storage.keep_last) failed: {type(self.error).__name__}: {self.error}; "
            "nothing committed was lost: the next iteration tries again, or run the "
            "gc-versions deployment"
        )
        log.warning(msg)
        return [msg]


_passes: dict[str, _Pass] = {}  # by run URL: the pass in flight
_lock = threading.Lock()


def start(ctx, keep_last: int) -> list[str]:
    """Wait for the run's pass in flight, then start ``ctx.gc(keep_last)`` in the
    background. Returns the warnings of the pass waited for."""
    with _lock:
        warnings = _wait(ctx.store.url)
        _passes[ctx.store.url] = _Pass(lambda: ctx.gc(keep_last))
    return warnings


def wait(ctx) -> list[str]:
    """Wait for the run's pass in flight (none: return at once); its warnings."""
    with _lock:
        return _wait(ctx.store.url)


def _wait(url: str) -> list[str]:
    running = _passes.pop(url, None)
    return running.wait() if running is not None else []
