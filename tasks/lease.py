"""Keeps the run's single-writer lease alive from a background thread.

If the holder dies, renewals stop and the lease expires after its TTL, so a new
``prefect-rl run`` can take over without ``--force``. If another writer took
the lease over (a renewal raises LeaseLostError), this run must stop: its
commits already fail by fence, and ``check()`` stops the driver loop before
it starts another iteration.
"""

from __future__ import annotations

import logging
import threading

from storage.errors import LeaseLostError
from tasks import retention

log = logging.getLogger("prefect_rl.lease")


class LeaseKeeper:
    def __init__(self, ctx):
        self.ctx = ctx
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lease-keeper", daemon=True)
        self.lost: LeaseLostError | None = None

    def _loop(self) -> None:
        while self.lost is None and not self._stop.wait(self.ctx.cfg.storage.lease_ttl_s / 3):
            self.renew()

    def renew(self) -> None:
        """Renew once; a lost lease is recorded (see ``check``) and never renewed again."""
        if self.lost is not None:
            return
        try:
            self.ctx.store.renew_lease(self.ctx.owner, self.ctx.cfg.storage.lease_ttl_s)
        except LeaseLostError as e:  # another writer holds the run now
            log.error("lease of run %r lost; stopping the run: %s", self.ctx.run_name, e)
            self.lost = e
        except Exception as e:  # a missed renewal is retried; the TTL leaves room for two
            log.warning("lease renewal failed: %s", e)

    def check(self) -> None:
        """Raise LeaseLostError if another writer took the lease over."""
        if self.lost is not None:
            raise LeaseLostError(
                f"run {self.ctx.run_name!r} stopped: its lease was taken over ({self.lost}); "
                "only one writer may run it: rerun it once the other writer has finished"
            )

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        # Only the holder may delete: a retention pass in flight ends before the release.
        retention.wait(self.ctx)
        self._stop.set()
        self._thread.join(timeout=5)
        if self.lost is None:  # a lost lease is the new holder's: leave it alone
            self.ctx.store.release_lease(self.ctx.owner)
