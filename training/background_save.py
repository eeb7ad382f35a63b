"""Durable writes in the background: checkpoints, and the publish of weights
that engines already received in memory. The state is copied to host memory at
once (``checkpoint.snapshot``, ``weights.host_copy``) and written by a thread
while the run goes on (the next rollout and train step).

Recovery never depends on them: a checkpoint counts only once its COMMIT is
written, and a restore falls back to the newest one that verifies and replays
the persisted rollouts after it; a version counts only once its manifest is
written, and in-memory transports push trainer state to the engines, so a lost
publish costs a durable copy, not a served version. So a failed or killed
background write is reported as a warning by the next one. One write of each
kind is in flight at a time: a new one first waits for the one before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("prefect_rl.training")


class InjectedWriteFault(RuntimeError):
    """The fault-injection hook failed a background write on purpose (tests)."""


CHECKPOINT_LOST = "recovery falls back to an older checkpoint and replays the rollouts after it"
VERSION_LOST = (
    "the engines were pushed that version in memory, so the run goes on; publish it "
    "again from its checkpoint with the publish-weights deployment if you need it on storage"
)


class BackgroundSaver:
    """One background write at a time (of ``what``), and what became of the last ones."""

    def __init__(self, what: str, if_lost: str) -> None:
        self.what, self.if_lost = what, if_lost  # "checkpoint", what a lost write means
        self._thread: threading.Thread | None = None
        self._failures: list[str] = []

    def start(self, k: int, write: Callable[[], Any], fail: bool = False) -> None:
        """Run ``write()`` (of k) on a thread; ``fail``: raise before it commits."""

        def run() -> None:
            try:
                if fail:
                    raise InjectedWriteFault(f"injected fault in the background write of {k}")
                write()
            except BaseException as e:  # noqa: BLE001 - reported by wait(), never lost
                log.error("background write of %s %d failed: %s", self.what, k, e)
                self._failures.append(
                    f"{self.what} {k} was not written ({type(e).__name__}: {e}); {self.if_lost}"
                )

        self._thread = threading.Thread(target=run, name=f"{self.what}-{k}", daemon=True)
        self._thread.start()

    def wait(self) -> list[str]:
        """Wait for the write in flight; the failures since the last call (warnings)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        failures, self._failures = self._failures, []
        return failures
