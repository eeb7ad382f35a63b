"""Errors raised by ``storage``. Each message names the object and the fix.

Owns the exception hierarchy only; nothing here touches a filesystem.
"""

from __future__ import annotations


class StorageError(RuntimeError):
    """Base class: anything that went wrong reading or writing run state."""


class ManifestError(StorageError):
    """A weights manifest (or checkpoint COMMIT) is missing, malformed or unsafe."""


class IntegrityError(StorageError):
    """Stored bytes do not match the sizes/sha256 recorded when they were committed."""


class LeaseHeldError(StorageError):
    """Another live writer holds the run's lease."""


class LeaseLostError(StorageError):
    """This writer's fence is no longer the run's current one: another writer took
    the run over, so every commit of this writer is refused."""


class VersionConflictError(StorageError):
    """An already committed object exists with different content."""
