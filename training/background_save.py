"""Checkpoints written in the background: the trainer's state is copied to host
memory at once (``checkpoint.snapshot``) and written by a thread while the run
goes on (the next rollout and train step).

Recovery never depends on it: a checkpoint counts only once its COMMIT is
written, and a restore falls back to the newest one that verifies and replays
the persisted rollouts after it. So a failed or killed background write loses
nothing but replay distance; the next save reports it as a warning. One write
is in flight at a time: a new save first waits for the one before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("prefect_rl.training")


class InjectedWriteFault(RuntimeError):
    """The fault-injection hook failed a background write on purpose (tests)."""


class BackgroundSaver:
    """One background checkpoint write at a time, and what became of the last ones."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._failures: list[str] = []

    def start(self, k: int, write: Callable[[], Any], fail: bool = False) -> None:
        """Run ``write()`` (checkpoint k) on a thread; ``fail``: raise before it commits."""

        def run() -> None:
            try:
                if fail:
                    raise InjectedWriteFault(f"injected fault in the background save of {k}")
                write()
            except BaseException as e:  # noqa: BLE001 - reported by wait(), never lost
                log.error("background save of checkpoint %d failed: %s", k, e)
                self._failures.append(
                    f"checkpoint {k} was not written ({type(e).__name__}: {e}); recovery "
                    "falls back to an older checkpoint and replays the rollouts after it"
                )

        self._thread = threading.Thread(target=run, name=f"ckpt-{k}", daemon=True)
        self._thread.start()

    def wait(self) -> list[str]:
        """Wait for the write in flight; the failures since the last call (warnings)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        failures, self._failures = self._failures, []
        return failures
