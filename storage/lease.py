"""The single-writer lease of a run (``lease.json``) and its fence.

Owns who may write a run. Two kinds of objects:

- ``lease.json``: the current lease (owner, token, fence, ttl_s, renewals,
  released). It is never deleted: release marks it ``released``, so the
  highest fence survives a release.
- ``lease-fences/000000000007.json``: one claim per acquisition, created
  if-absent (O_EXCL link locally, If-None-Match on S3). Two takers racing for
  fence 7 cannot both create it, so every fence belongs to one acquisition.
  Claims are never deleted; they are the run's history of writers.

**Fencing.** An acquisition gets fence = highest fence seen (lease.json and
claims) + 1. A ``RunStore`` built with that fence reads lease.json just before
each commit and raises ``LeaseLostError`` when lease.json holds another fence.
What this guarantees: once a taker has written lease.json, every later check
of the old writer fails, so each of the old writer's threads makes at most the
one commit it had already checked. A check-then-write is not atomic (neither
S3 nor a plain filesystem makes a PUT conditional on another object), so that
one commit can still land after the takeover; nothing committed earlier is
rolled back.

**Takeover without trusting clocks.** Two hosts' wall clocks differ (a clock 5
minutes ahead used to see a live lease as expired), so a taker never decides
from ``expires_at``. A lease not marked released is live while its holder
renews it, and every renewal bumps ``renewals``. A taker watches lease.json by
its own monotonic clock for the holder's ``ttl_s``: any change means live
(``LeaseHeldError``), none means the holder stopped, and the taker takes over.
A claim newer than lease.json (a taker between its claim and its lease.json
write, or one that died there) is watched the same way, as a holder that has
not renewed yet. Taken at once: a released lease, ``force=True``, and a holder
on this host (owner ``"host:pid"``) whose pid no longer exists. That last rule
assumes one pid namespace per host name; two containers sharing a host name
but not their pids would see each other's writers as dead.

Remaining window (documented, not closed): a renewal that reads lease.json
just before a taker writes it, and writes just after, puts the old fence back.
Then the old holder keeps the run and the taker fails its read-back or its
first fence check, so there is still one writer. A renewal first checks that
no higher fence was claimed, so this needs the holder to renew exactly as the
taker ends ``ttl_s`` of watching it silent.
"""

from __future__ import annotations

import os
import time
import uuid

import fsspec
from pydantic import ValidationError

from storage.errors import LeaseHeldError, LeaseLostError, StorageError
from storage.fs import dumps, join, ls_names, read_json, write_bytes
from storage.layout import LEASE_FENCES, fence_name
from storage.types import Lease

# Longest pause between two reads while watching a holder: bounds takeover latency.
_POLL_MAX_S = 1.0
_sleep = time.sleep  # module-level so tests can prove a takeover did not wait


def read_lease(fs: fsspec.AbstractFileSystem, path: str) -> Lease | None:
    raw = read_json(fs, path)
    if raw is None:
        return None
    try:
        return Lease.model_validate(raw)
    except ValidationError as e:
        raise StorageError(
            f"{path} is malformed ({e.errors()[0]['msg']}); acquire with force=True to replace it"
        ) from e


def _fences_dir(path: str) -> str:
    return join(path.rsplit("/", 1)[0], LEASE_FENCES)


def _highest_claim(fs: fsspec.AbstractFileSystem, path: str) -> int:
    names = ls_names(fs, _fences_dir(path))
    fences = [int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit()]
    return max(fences, default=0)


def _held_error(lease: Lease, path: str, why: str) -> LeaseHeldError:
    return LeaseHeldError(
        f"run at {path} is leased by {lease.owner!r} (fence {lease.fence}), which {why}; "
        "wait until that writer is done or stop it, or acquire with force=True only if it is dead"
    )


def owner_dead_here(owner: str) -> bool:
    """True only when ``owner`` is ``"host:pid"`` of this host and that pid is gone."""
    host, sep, pid = owner.rpartition(":")
    if not sep or host != os.uname().nodename or not pid.isdigit() or int(pid) <= 0:
        return False
    try:
        os.kill(int(pid), 0)  # signal 0: existence check only
    except ProcessLookupError:
        return True
    except PermissionError:  # exists, owned by another user
        return False
    return False


def _key(lease: Lease | None) -> tuple | None:
    return None if lease is None else (lease.token, lease.fence, lease.renewals)


def _watch(
    fs: fsspec.AbstractFileSystem,
    path: str,
    seen: Lease | None,
    holder: Lease,
    until_released: bool = True,
) -> None:
    """Return once lease.json stayed as ``seen`` for ``holder.ttl_s`` by our monotonic
    clock (or, with ``until_released``, was released); raise LeaseHeldError as soon as
    it changes: the holder renewed it, or someone else wrote a new lease."""
    deadline = time.monotonic() + holder.ttl_s
    step = min(max(holder.ttl_s / 10, 0.01), _POLL_MAX_S)
    while (left := deadline - time.monotonic()) > 0:
        _sleep(min(left, step))
        now = read_lease(fs, path)
        if _key(now) != _key(seen):
            raise _held_error(now or holder, path, "renewed or took it while this writer waited")
        if until_released and now is not None and now.released:
            return


def acquire_lease(
    fs: fsspec.AbstractFileSystem,
    path: str,
    owner: str,
    ttl_s: float,
    force: bool = False,
    wait: bool = True,
) -> Lease:
    """Take the run's lease and return it with its new fence. May block for up to the
    holder's ttl_s while it watches a holder that might be dead (see module doc);
    ``wait=False`` refuses such a lease at once instead."""
    if ttl_s <= 0:
        raise StorageError(f"lease ttl_s must be > 0, got {ttl_s}")
    try:
        current = read_lease(fs, path)
    except StorageError:
        if not force:
            raise
        current = None  # malformed: force replaces it; the claims still give the fence
    if current is not None and not current.released and not force:
        if current.owner == owner:  # this very process again: keep its fence
            return renew_lease(fs, path, owner, ttl_s, current.fence)
        _wait_for(fs, path, current, current, wait, until_released=True)
    highest = _highest_claim(fs, path)
    if highest > (current.fence if current else 0) and not force:
        # A claim newer than lease.json: a taker is between its claim and its lease.json
        # write (or died there). It counts as a holder that has not renewed yet.
        raw = read_json(fs, join(_fences_dir(path), fence_name(highest)))
        if raw is not None:
            _wait_for(fs, path, current, Lease.model_validate(raw), wait, until_released=False)
    fence = 1 + max(current.fence if current else 0, highest)
    now = time.time()
    mine = Lease(
        owner=owner,
        token=uuid.uuid4().hex,
        acquired_at=now,
        expires_at=now + ttl_s,
        fence=fence,
        ttl_s=ttl_s,
    )
    blob = dumps(mine.model_dump())
    if not write_bytes(fs, join(_fences_dir(path), fence_name(fence)), blob, exclusive=True):
        raw = read_json(fs, join(_fences_dir(path), fence_name(fence))) or {}
        raise LeaseHeldError(
            f"{raw.get('owner', 'another writer')!r} took the run at {path} (fence {fence}) while "
            f"{owner!r} was taking it; wait until that writer is done, then rerun"
        )
    write_bytes(fs, path, blob)
    back = read_lease(fs, path)
    if back is None or back.token != mine.token:
        raise _held_error(back or mine, path, "overwrote the lease while it was being taken")
    return mine


def _wait_for(
    fs: fsspec.AbstractFileSystem,
    path: str,
    seen: Lease | None,
    holder: Lease,
    wait: bool,
    until_released: bool,
) -> None:
    """Return when ``holder`` may be taken over; LeaseHeldError while it may be alive."""
    if owner_dead_here(holder.owner):
        return
    if not wait:
        raise _held_error(holder, path, "may still be alive (wait=False: not watched)")
    _watch(fs, path, seen, holder, until_released)


def _lost(path: str, owner: str | None, fence: int | None, current: Lease | None) -> LeaseLostError:
    if current is None:
        now = "lease.json is gone"
    elif current.released and current.fence == fence:
        now = "the lease was released"
    else:
        now = f"another writer ({current.owner!r}) took the run at fence {current.fence}"
    who = "this writer" if owner is None else repr(owner)
    return LeaseLostError(
        f"{who} (fence {fence}) lost the lease at {path}: {now}; this writer must stop; "
        "rerun once the other writer is done"
    )


def renew_lease(
    fs: fsspec.AbstractFileSystem, path: str, owner: str, ttl_s: float, fence: int | None = None
) -> Lease:
    """Bump ``renewals`` (the sign of life takers watch for). ``fence``: the holder's
    own; None accepts whatever fence this owner holds."""
    current = read_lease(fs, path)
    mine = (
        current is not None
        and current.owner == owner
        and not current.released
        and (fence is None or current.fence == fence)
    )
    if not mine:
        raise _lost(path, owner, fence, current)
    assert current is not None
    claim = read_json(fs, join(_fences_dir(path), fence_name(current.fence + 1)))
    if claim is not None:
        # A taker claimed the next fence and is about to write lease.json: do not overwrite it.
        raise _lost(path, owner, current.fence, Lease.model_validate(claim))
    new = current.model_copy(
        update={"expires_at": time.time() + ttl_s, "ttl_s": ttl_s, "renewals": current.renewals + 1}
    )
    write_bytes(fs, path, dumps(new.model_dump()))
    return new


def release_lease(
    fs: fsspec.AbstractFileSystem, path: str, owner: str, fence: int | None = None
) -> None:
    """Mark our lease released (fence kept); a lease held by someone else is left alone."""
    current = read_lease(fs, path)
    if current is None or current.owner != owner or current.released:
        return
    if fence is not None and current.fence != fence:
        return
    write_bytes(fs, path, dumps(current.model_copy(update={"released": True}).model_dump()))


def check_fence(fs: fsspec.AbstractFileSystem, path: str, fence: int) -> None:
    """Raise LeaseLostError unless lease.json still carries ``fence`` (called before commits).
    A lease we released ourselves still passes: nobody else has taken the run yet."""
    current = read_lease(fs, path)
    if current is None or current.fence != fence:
        raise _lost(path, None, fence, current)
