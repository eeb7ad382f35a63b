"""Weight versions: ``weights/v000012/`` holding HF files plus ``manifest.json``.

Owns the publish side (``WeightsWriter``) and reading/validating manifests. The
commit rule: a version exists for readers iff its manifest exists and parses.
Local disk: files go to a staging folder, are fsynced, the manifest is written
and fsynced, then the folder is renamed into place. S3: files are uploaded to
the version prefix, then the manifest PUT commits. Must never modify a
committed version.

Failure: a file that fails while written or closed (an exception in its
``with`` block, or inside ``write`` or ``close``: disk full) abandons the whole
writer at once, removing its staging folder (local) or its partial objects
(S3, best effort). A local writer holds its staging folder
(``.tmp-v000012-{host}-{pid}-{uuid}``) locked while it lives (``storage.staging``),
so every new writer, and retention, removes the staging that no live writer
holds: a dead writer's, or one dropped after a failure its caller never cleaned up.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import fsspec

from storage import staging, tree
from storage.errors import ManifestError, StorageError, VersionConflictError
from storage.fs import dumps, fsync_dir, is_local, join, rm_tree, write_bytes
from storage.hashio import (
    READ_CHUNK,
    HashingWriter,
    LocalHashingWriter,
    NullHashingWriter,
    S3HashingWriter,
)
from storage.integrity import verify_dir
from storage.layout import MANIFEST, TMP_PREFIX, check_file_name, version_name
from storage.manifests import committed_versions, parse_manifest, read_manifest
from storage.types import AdapterOf, DeltaOf, FileEntry, WeightsManifest

log = logging.getLogger("storage")

# Re-exported: the engines load folders through storage.weights.
# The staging folders of weight writers (any version) in a weights folder.
STAGING_PREFIX = f"{TMP_PREFIX}v"

__all__ = [
    "STAGING_PREFIX",
    "WeightsWriter",
    "committed_versions",
    "parse_manifest",
    "read_manifest",
    "verify_dir",
]


class WeightsWriter:
    """Publishes one version. ``open(name)`` streams a file, ``add_file`` copies one,
    ``commit()`` writes the manifest last and returns it.

    If the version is already committed when the writer is made, nothing is
    written: files are only hashed, and ``commit`` returns the existing manifest
    when the content is identical, else raises VersionConflictError.
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        weights_dir: str,
        run: str,
        version: int,
        iteration: int,
        parent: int | None,
        max_inflight_parts: int = 8,
        guard: Callable[[], None] | None = None,
        on_commit: Callable[[WeightsManifest, str], None] | None = None,
    ):
        self.fs, self.run, self.version = fs, run, version
        self.iteration, self.parent = iteration, parent
        self._weights_dir = weights_dir
        self._final = join(weights_dir, version_name(version))
        self._local = is_local(fs)
        self._inflight = max_inflight_parts
        self._lock = threading.Lock()
        self._open: dict[str, HashingWriter] = {}
        self._done: dict[str, FileEntry] = {}
        self._fsyncs: list[Future] = []
        self._sync_pool = (
            ThreadPoolExecutor(max_workers=2, thread_name_prefix="storage-fsync")
            if self._local
            else None
        )
        self._failed: str | None = None
        self._finished = False
        # Called just before the commit (and before deleting anything): the fence check.
        self._guard = guard or (lambda: None)
        # Called with the manifest and the committed local folder once a local commit
        # renamed it into place (storage.delta remembers the hashes of a future base).
        self._on_commit = on_commit
        try:
            self._existing: WeightsManifest | None = read_manifest(fs, weights_dir, version)
        except ManifestError:
            self._existing = None
        if self._existing is not None:
            self._stage = ""
        elif self._local:
            # Staging no live writer holds: a dead writer's, or a failed one's whose process
            # lives on (a train actor). Any version's: the run gave up on some of them.
            staging.sweep(weights_dir, STAGING_PREFIX)
            # host and pid in the name tell an operator whose it is; the lock tells the sweep.
            self._held = staging.Stage.create(
                weights_dir,
                f"{TMP_PREFIX}{version_name(version)}-{os.uname().nodename}-{os.getpid()}-",
            )
            self._stage = self._held.path
        else:
            # Leftovers of an earlier failed attempt are invisible (no manifest) but would mix in.
            self._guard()
            rm_tree(fs, self._final)
            self._stage = self._final

    @property
    def already_committed(self) -> bool:
        """True when this version existed before the writer was made (verify-only mode)."""
        return self._existing is not None

    def open(self, name: str) -> HashingWriter:
        """A binary writable file (context manager) that hashes and counts while writing."""
        check_file_name(name, (MANIFEST,))
        with self._lock:
            if self._finished:
                raise StorageError(
                    f"weights writer for {version_name(self.version)} is already committed/aborted"
                )
            if self._failed:  # its staging is gone: a new file would recreate and leak it
                raise StorageError(
                    f"file {self._failed!r} failed while writing; {version_name(self.version)} "
                    "was abandoned, publish it again with a new writer"
                )
            if name in self._open or name in self._done:
                raise StorageError(
                    f"file {name!r} was already written to {version_name(self.version)}; names must be unique"
                )
            if self._existing is not None:  # only its sha256 is compared (file_set)
                w: HashingWriter = NullHashingWriter(name, self._closed)
            elif self._local:
                w = LocalHashingWriter(
                    name, join(self._stage, name), self._closed, chunks=tree.CHUNK
                )
            else:
                w = S3HashingWriter(
                    name,
                    self.fs,
                    join(self._stage, name),
                    self._closed,
                    max_inflight=self._inflight,
                    chunks=tree.CHUNK,
                )
            self._open[name] = w
        orig_abort = w.abort

        def abort() -> None:  # a file that failed mid-write poisons the whole version
            self._failed = self._failed or name
            orig_abort()
            self._cleanup()  # a failed writer leaves no staging behind (disk full, ...)

        w.abort = abort  # type: ignore[method-assign]
        return w

    def _closed(self, w: HashingWriter) -> None:
        with self._lock:
            self._open.pop(w.name, None)
            self._done[w.name] = w.entry()
            if isinstance(w, LocalHashingWriter) and self._sync_pool is not None:
                # fsync off the producer's thread so the next shard is written meanwhile.
                self._fsyncs.append(self._sync_pool.submit(_fsync_path, w.path))

    def add_file(self, name: str, local_path: str) -> FileEntry:
        """Copy an existing local file (config.json, tokenizer files, ...) into the version."""
        with open(local_path, "rb", buffering=0) as src, self.open(name) as dst:
            buf = bytearray(READ_CHUNK)
            view = memoryview(buf)
            while n := src.readinto(buf):
                dst.write(view[:n])
        return self._done[name]

    def written(self) -> dict[str, FileEntry]:
        """The files closed so far: name -> entry (what the manifest will list)."""
        with self._lock:
            return dict(self._done)

    def commit(
        self, delta: DeltaOf | None = None, adapter: AdapterOf | None = None
    ) -> WeightsManifest:
        """Write manifest.json last (the commit) and return it; ``delta`` makes the
        version a delta of ``delta.base`` (``storage.delta.DeltaWriter`` passes it),
        ``adapter`` a LoRA adapter of ``adapter.base`` (``RunStore.adapter_of``)."""
        with self._lock:
            if self._failed:
                raise StorageError(
                    f"file {self._failed!r} failed while writing; {version_name(self.version)} was not committed, publish it again"
                )
            if self._open:
                raise StorageError(
                    f"files {sorted(self._open)} were opened but not closed; close them before commit"
                )
            if self._finished:
                raise StorageError(
                    f"weights writer for {version_name(self.version)} was already committed/aborted"
                )
            self._finished = True
        try:
            if self._existing is not None:
                self._guard()
                return self._same_or_conflict(self._existing)
            m = WeightsManifest(
                version=self.version,
                run=self.run,
                iteration=self.iteration,
                parent=self.parent,
                created_at=time.time(),
                files=tuple(sorted(self._done.values(), key=lambda f: f.name)),
                delta=delta,
                adapter=adapter,
            )
            if self._local:
                return self._commit_local(m)
            self._guard()
            write_bytes(self.fs, join(self._final, MANIFEST), dumps(m.dump()))
            return m
        except BaseException:
            self._cleanup()
            raise
        finally:
            if self._sync_pool is not None:
                self._sync_pool.shutdown(wait=True)

    def _commit_local(self, m: WeightsManifest) -> WeightsManifest:
        for f in self._fsyncs:
            f.result()
        _write_fsynced(join(self._stage, MANIFEST), dumps(m.dump()))
        fsync_dir(self._stage)
        if os.path.isdir(self._final):
            try:
                existing = read_manifest(self.fs, self._weights_dir, self.version)
            except ManifestError:
                shutil.rmtree(self._final)  # torn leftover (e.g. an interrupted gc): not a version
            else:  # someone committed meanwhile
                self._cleanup()
                return self._same_or_conflict(existing, m)
        self._guard()
        os.rename(self._stage, self._final)
        self._held.release()  # it is the version now, no longer staging
        fsync_dir(self._weights_dir)
        if self._on_commit is not None:
            self._on_commit(m, self._final)
        return m

    def _same_or_conflict(
        self, existing: WeightsManifest, new: WeightsManifest | None = None
    ) -> WeightsManifest:
        files = (
            new.file_set() if new else {(f.name, f.bytes, f.sha256) for f in self._done.values()}
        )
        if files == existing.file_set():
            return existing
        diff = sorted({n for n, _, _ in files ^ existing.file_set()})
        raise VersionConflictError(
            f"{version_name(self.version)} is already committed with different content (files differ: {diff[:5]}); "
            "versions are immutable: publish under a new version, or delete this one with gc first"
        )

    def abort(self) -> None:
        """Drop everything written so far; the version stays uncommitted."""
        with self._lock:
            self._finished = True
            writers = list(self._open.values())
        for w in writers:
            w.abort()
        if self._sync_pool is not None:
            self._sync_pool.shutdown(wait=True)
        self._cleanup()

    def _cleanup(self) -> None:
        if not self._stage:
            return
        if self._local:
            self._held.remove()
            return
        # S3 writes into the version prefix itself: remove the partial objects unless a
        # manifest made them a version meanwhile. Best effort: the endpoint may be what failed,
        # and leftovers stay invisible (no manifest) until the next writer or gc removes them.
        try:
            if not self.fs.exists(join(self._final, MANIFEST)):
                rm_tree(self.fs, self._final)
        except Exception as e:
            log.warning("could not remove partial upload %s: %s", self._final, e)

    def __enter__(self) -> WeightsWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._finished:
            self.abort()


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_fsynced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
