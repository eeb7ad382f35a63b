"""storage: where a run's state lives, on any fsspec root (local disk, s3://, ...).

Contracts:
- ``RunStore(cfg, run)`` is the only entry point for run state; ``fs.open_root``
  is the only way to open a root. Credentials come from the AWS environment
  variables and are never stored, printed or put into URLs.
- Commit rule: data first, commit marker last (weights ``manifest.json``,
  checkpoint ``COMMIT``, one atomic object per ledger record). Readers trust
  nothing without its marker, and verify sizes + sha256 when they pull.
- Committed objects are immutable; re-writing identical content is a no-op,
  different content raises ``VersionConflictError``.
- Imports neither prefect, ray nor torch.
"""

from storage.config import S3Options, StorageConfig
from storage.errors import (
    IntegrityError,
    LeaseHeldError,
    ManifestError,
    StorageError,
    VersionConflictError,
)
from storage.fs import is_local, open_root
from storage.run_store import CheckpointWriter, RunStore, WeightsWriter
from storage.types import CheckpointCommit, FileEntry, GcReport, Lease, WeightsManifest

__all__ = [
    "CheckpointCommit",
    "CheckpointWriter",
    "FileEntry",
    "GcReport",
    "IntegrityError",
    "Lease",
    "LeaseHeldError",
    "ManifestError",
    "RunStore",
    "S3Options",
    "StorageConfig",
    "StorageError",
    "VersionConflictError",
    "WeightsManifest",
    "WeightsWriter",
    "is_local",
    "open_root",
]
