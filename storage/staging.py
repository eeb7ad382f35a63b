"""Local staging folders (``weights/.tmp-v000012-...``) and who may remove them.

Owns one rule: a staging folder belongs to a live writer exactly while that
writer holds an exclusive ``flock`` on it. A writer takes the lock as it makes
the folder and keeps it until it has renamed the folder into place or removed
it; a process that dies, or a writer object that is dropped, lets the lock go
with its descriptor. So a sweep removes precisely what no live writer holds,
whether its writer died, gave up on a full disk in a process that lives on
(a detached train actor), or ran on this host or another one sharing the folder
(flock over NFS is a POSIX lock on Linux). Nothing here judges by pids or
clocks, except the fallback below.

Where a filesystem cannot lock at all, a sweep keeps what it cannot judge until
it is older than ``GRACE_S``. Local disk only: on S3 a writer stages under the
version's own prefix, which an uncommitted-version rule covers (retention).
Imports neither prefect, ray nor torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import time
import uuid
import weakref
from collections.abc import Callable

log = logging.getLogger("storage")

# Only where locks are unsupported: staging older than this counts as abandoned.
GRACE_S = 3600.0


class Stage:
    """A staging folder held by its writer (the lock lives as long as this object
    or until ``release``)."""

    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd: int | None = fd
        # A writer dropped without commit or abort still lets its staging go.
        self._finalizer = weakref.finalize(self, _close_quietly, fd)

    @classmethod
    def create(cls, parent: str, stem: str) -> Stage:
        """Make and hold a new folder ``{parent}/{stem}{random}``."""
        while True:
            path = os.path.join(parent, f"{stem}{uuid.uuid4().hex}")
            os.makedirs(path)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                _lock(fd, blocking=True)
            except OSError as e:  # no locks on this filesystem: the grace period protects it
                if e.errno not in _NO_LOCKS:
                    os.close(fd)
                    raise
            if _same(fd, path):
                return cls(path, fd)
            # A sweep took the folder between mkdir and the lock (it deletes while it
            # holds the lock): that name is gone, so make another.
            os.close(fd)

    def release(self) -> None:
        """Let the folder go (after it was renamed into place or removed)."""
        self._finalizer()
        self._fd = None

    def remove(self) -> None:
        """Delete the folder, then let it go: nothing of a failed writer is left."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.release()


def sweep(parent: str, prefix: str, guard: Callable[[], None] | None = None) -> list[str]:
    """Remove every folder in ``parent`` named ``prefix*`` that no live writer holds;
    the paths removed. ``guard`` runs before each removal (the lease holder's fence)."""
    try:
        names = sorted(n for n in os.listdir(parent) if n.startswith(prefix))
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        path = os.path.join(parent, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile (committed or removed), or not a folder
            continue
        try:
            if not _abandoned(fd, path) or not _same(fd, path):
                continue
            if guard is not None:
                guard()
            log.info("removing staging %s: no live writer holds it", path)
            shutil.rmtree(path, ignore_errors=True)  # under the lock: no writer can start in it
            removed.append(path)
        finally:
            os.close(fd)
    return removed


# errnos of a filesystem that has no flock (FUSE mounts, some network filesystems)
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _abandoned(fd: int, path: str) -> bool:
    try:
        _lock(fd, blocking=False)
    except BlockingIOError:
        return False  # a live writer holds it
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            return False
        return time.time() - os.fstat(fd).st_mtime > GRACE_S
    return True


def _lock(fd: int, blocking: bool) -> None:
    fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))


def _same(fd: int, path: str) -> bool:
    """True while ``path`` still names the folder open as ``fd``."""
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(path))
    except FileNotFoundError:
        return False


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
