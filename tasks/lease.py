"""Keeps the run's single-writer lease alive from a background thread, from the
moment it is taken until it is released.

A taker judges a holder only by its renewals (``storage.lease``: lease.json
unchanged for the TTL by the taker's own monotonic clock, never a comparison of
wall clocks). So a holder must renew for as long as it holds the lease, also
while it is still setting up: ``take_lease`` starts the renewals (``hold``) the
moment the lease is taken, and the ``LeaseKeeper`` of the flow adopts them:
writing run.json and publishing a large base model can take longer than the
TTL, and a holder silent that long would let a second ``prefect-rl run``
(whatever its clock) take a live run over.

If the holder dies, renewals stop and a new ``prefect-rl run`` takes over after
the TTL without ``--force``. If another writer took the lease over (a renewal
raises LeaseLostError), this run must stop: its commits already fail by fence,
and ``check()`` stops the driver loop before it starts another iteration.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from storage.errors import LeaseLostError
from tasks import retention

if TYPE_CHECKING:
    from tasks.context import RunContext

log = logging.getLogger("prefect_rl.lease")


class _Renewals:
    """The thread that renews one acquisition of the lease every TTL/3."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.lost: LeaseLostError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lease-keeper", daemon=True)

    def _loop(self) -> None:
        while self.lost is None and not self._stop.wait(self.ctx.cfg.storage.lease_ttl_s / 3):
            self.renew()

    def renew(self) -> None:
        if self.lost is not None:
            return
        try:
            self.ctx.store.renew_lease(self.ctx.owner, self.ctx.cfg.storage.lease_ttl_s)
        except LeaseLostError as e:  # another writer holds the run now
            log.error("lease of run %r lost; stopping the run: %s", self.ctx.run_name, e)
            self.lost = e
        except Exception as e:  # a missed renewal is retried; the TTL leaves room for two
            log.warning("lease renewal failed: %s", e)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


# One renewal thread per acquisition held by this process: (run folder, owner, fence).
_held: dict[tuple[str, str, int | None], _Renewals] = {}
_held_lock = threading.Lock()


def _key(ctx: RunContext) -> tuple[str, str, int | None]:
    return (ctx.store.url, ctx.owner, ctx.fence)


def hold(ctx: RunContext) -> _Renewals:
    """Renew ``ctx``'s lease from now on (idempotent: the running renewals, if any)."""
    with _held_lock:
        renewals = _held.get(_key(ctx))
        if renewals is None:
            renewals = _held[_key(ctx)] = _Renewals(ctx)
            renewals.start()
        return renewals


def release(ctx: RunContext) -> None:
    """Stop renewing and release the lease (left alone when another writer took it)."""
    with _held_lock:
        renewals = _held.pop(_key(ctx), None)
    if renewals is not None:
        renewals.stop()
        if renewals.lost is not None:  # a lost lease is the new holder's
            return
    ctx.store.release_lease(ctx.owner)


class LeaseKeeper:
    """The flow's hold on the lease: adopts the renewals ``take_lease`` started (or
    starts them), and on exit waits for retention, then releases the lease."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self._renewals: _Renewals | None = None

    @property
    def lost(self) -> LeaseLostError | None:
        return None if self._renewals is None else self._renewals.lost

    def renew(self) -> None:
        """Renew once; a lost lease is recorded (see ``check``) and never renewed again."""
        if self._renewals is None:
            self._renewals = hold(self.ctx)
        self._renewals.renew()

    def check(self) -> None:
        """Raise LeaseLostError if another writer took the lease over."""
        if self.lost is not None:
            raise LeaseLostError(
                f"run {self.ctx.run_name!r} stopped: its lease was taken over ({self.lost}); "
                "only one writer may run it: rerun it once the other writer has finished"
            )

    def __enter__(self) -> LeaseKeeper:
        self._renewals = hold(self.ctx)
        return self

    def __exit__(self, *exc) -> None:
        # Only the holder may delete: a retention pass in flight ends before the release.
        retention.wait(self.ctx)
        release(self.ctx)
