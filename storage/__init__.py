"""storage: where a run's state lives, on any fsspec root (local disk, s3://, ...).

Contracts:
- ``RunStore(cfg, run)`` is the only entry point for run state; ``fs.open_root``
  is the only way to open a root. Credentials come from the AWS environment
  variables and are never stored, printed or put into URLs.
- Commit rule: data first, commit marker last (weights ``manifest.json``,
  checkpoint ``COMMIT``, one atomic object per ledger record). Readers trust
  nothing without its marker, and verify sizes and hashes when they pull: a weight
  file's hash tree (``storage.tree``: BLAKE3 per 8 MiB chunk on every core, a root
  binding size, sha256 and chunks; the damaged chunk is named), or the sha256 of a
  file written before trees (and of checkpoint files).
- Committed objects are immutable; re-writing identical content is a no-op,
  different content raises ``VersionConflictError``.
- One writer per run: ``acquire_lease`` returns a ``Lease`` with a ``fence``; a
  ``RunStore(cfg, run, fence=N)`` checks lease.json before every commit and raises
  ``LeaseLostError`` once another writer took the run (``storage.lease``).
- Loaders trust a folder only after ``verify_dir`` (sizes and trees, or sha256,
  against its own manifest.json); ``RunStore.version_state`` tells committed /
  absent / damaged, and the holder may ``discard_damaged_version`` to publish a
  damaged one again.
- A local staging folder is its writer's while the writer holds its flock
  (``storage.staging``); new writers and gc remove the staging nobody holds.
- ``storage.runs`` lists a root's runs read-only; a damaged record is shown, never fatal.
- A version may be a delta of an earlier full version (``storage.delta``: XOR per
  tensor, zstd; its manifest names the base and the full files' sha256 and trees).
  Only a pull reads one: it rebuilds the full files and verifies each chunk as it
  writes it, taking unchanged chunks' hashes from the base's tree (``storage.rebuild``);
  ``verify_dir`` refuses a delta folder. Retention keeps a kept delta's base.
- A version may be a LoRA adapter of a full version (``storage.adapters``: peft's
  ``adapter_model.safetensors`` and ``adapter_config.json``, hashed like any file;
  its manifest names the base version and the digest of the base's files). A pull
  refuses it when the base is missing or of other bytes, and so do engines that hold
  another base. Retention keeps a kept adapter's base.
- ``check_root(cfg)`` before anything starts turns bad roots into clear errors.
- Imports neither prefect, ray nor torch.
"""

from storage.config import S3Options, StorageConfig
from storage.errors import (
    IntegrityError,
    LeaseHeldError,
    LeaseLostError,
    ManifestError,
    StorageError,
    VersionConflictError,
)
from storage.fs import check_root, is_local, open_root
from storage.run_store import CheckpointWriter, RunStore, WeightsWriter
from storage.types import CheckpointCommit, FileEntry, GcReport, Lease, WeightsManifest
from storage.weights import verify_dir

__all__ = [
    "CheckpointCommit",
    "CheckpointWriter",
    "FileEntry",
    "GcReport",
    "IntegrityError",
    "Lease",
    "LeaseHeldError",
    "LeaseLostError",
    "ManifestError",
    "RunStore",
    "S3Options",
    "StorageConfig",
    "StorageError",
    "VersionConflictError",
    "WeightsManifest",
    "WeightsWriter",
    "check_root",
    "is_local",
    "open_root",
    "verify_dir",
]
