"""The single-writer lease of a run (``lease.json``).

Owns who may write a run. Acquire = write our lease, then read it back: on a
race the last PUT wins and the loser sees someone else's lease and is refused,
so at most one caller leaves ``acquire_lease`` holding it. Expiry is wall-clock
(``expires_at``); holders renew well before ``ttl_s`` runs out. Must not
sleep or retry: callers decide.

Known limit: taking over an *expired* lease is last-writer-wins plus a
read-back, so two takers racing within one round trip could both pass the
read-back. A fresh lease (no lease.json) is created exclusively (O_EXCL link
locally, If-None-Match on S3) and has no such window.
"""

from __future__ import annotations

import time
import uuid

import fsspec
from pydantic import ValidationError

from storage.errors import LeaseHeldError, StorageError
from storage.fs import dumps, read_json, rm_file, write_bytes
from storage.types import Lease


def read_lease(fs: fsspec.AbstractFileSystem, path: str) -> Lease | None:
    raw = read_json(fs, path)
    if raw is None:
        return None
    try:
        return Lease.model_validate(raw)
    except ValidationError as e:
        raise StorageError(
            f"{path} is malformed ({e.errors()[0]['msg']}); delete it or acquire with force=True"
        ) from e


def _held_error(lease: Lease, path: str, now: float) -> LeaseHeldError:
    return LeaseHeldError(
        f"run is leased by {lease.owner!r} until {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(lease.expires_at))} UTC "
        f"({lease.expires_at - now:.0f}s from now) at {path}; wait for it to expire, stop that writer, "
        "or acquire with force=True if it is dead"
    )


def acquire_lease(
    fs: fsspec.AbstractFileSystem, path: str, owner: str, ttl_s: float, force: bool = False
) -> Lease:
    if ttl_s <= 0:
        raise StorageError(f"lease ttl_s must be > 0, got {ttl_s}")
    now = time.time()
    current = None if force else read_lease(fs, path)
    if current is not None and current.owner != owner and current.live(now):
        raise _held_error(current, path, now)
    mine = Lease(owner=owner, token=uuid.uuid4().hex, acquired_at=now, expires_at=now + ttl_s)
    if current is None and not force:
        # Nobody holds it: create-if-absent, so two first writers cannot both win.
        if not write_bytes(fs, path, dumps(mine.model_dump()), exclusive=True):
            return acquire_lease(fs, path, owner, ttl_s, force=False)
    else:
        write_bytes(fs, path, dumps(mine.model_dump()))
    back = read_lease(fs, path)
    if back is None or back.token != mine.token:
        holder = back or mine
        raise _held_error(holder, path, time.time())
    return mine


def renew_lease(fs: fsspec.AbstractFileSystem, path: str, owner: str, ttl_s: float) -> Lease:
    now = time.time()
    current = read_lease(fs, path)
    if current is None or current.owner != owner:
        who = "nobody" if current is None else repr(current.owner)
        raise LeaseHeldError(
            f"{owner!r} cannot renew the lease at {path}: it is held by {who}; the lease was lost "
            "(expired and taken over, or forced): stop writing and acquire it again"
        )
    new = Lease(
        owner=owner, token=current.token, acquired_at=current.acquired_at, expires_at=now + ttl_s
    )
    write_bytes(fs, path, dumps(new.model_dump()))
    return new


def release_lease(fs: fsspec.AbstractFileSystem, path: str, owner: str) -> None:
    """Remove our lease; a lease held by someone else (or none) is left alone."""
    current = read_lease(fs, path)
    if current is not None and current.owner == owner:
        rm_file(fs, path)
