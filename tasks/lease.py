"""Keeps the run's single-writer lease alive from a background thread.

If the holder dies, renewals stop and the lease expires after its TTL, so a new
``prefect-rl run`` can take over without ``--force``.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("prefect_rl.lease")


class LeaseKeeper:
    def __init__(self, ctx):
        self.ctx = ctx
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lease-keeper", daemon=True)

    def _loop(self) -> None:
        ttl = self.ctx.cfg.storage.lease_ttl_s
        while not self._stop.wait(ttl / 3):
            try:
                self.ctx.store.renew_lease(self.ctx.owner, ttl)
            except Exception as e:  # a missed renewal is retried; the TTL leaves room for two
                log.warning("lease renewal failed: %s", e)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.ctx.store.release_lease(self.ctx.owner)
