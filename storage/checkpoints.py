"""Trainer checkpoints: ``checkpoints/iter_000012/<files>`` plus ``COMMIT``.

Owns the checkpoint commit rule: files first, then COMMIT (JSON with each
file's bytes and sha256, and the caller's meta) last; a folder without COMMIT
is not a checkpoint. Readers verify sizes and digests. Must never rewrite the
files of a committed checkpoint.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import fsspec
from pydantic import ValidationError

from storage.errors import IntegrityError, ManifestError, StorageError, VersionConflictError
from storage.fs import (
    dumps,
    is_local,
    join,
    ls_names,
    parse_iter_dirs,
    read_bytes,
    rm_tree,
    write_bytes,
)
from storage.hashio import (
    HashingWriter,
    LocalHashingWriter,
    NullHashingWriter,
    S3HashingWriter,
    VerifyingReader,
    hash_stream,
)
from storage.layout import COMMIT, check_file_name, iter_name
from storage.types import CheckpointCommit, FileEntry


def read_commit(fs: fsspec.AbstractFileSystem, ckpt_dir: str, k: int) -> CheckpointCommit:
    path = join(ckpt_dir, iter_name(k), COMMIT)
    data = read_bytes(fs, path)
    if data is None:
        raise ManifestError(
            f"{path} is missing: checkpoint {k} was never committed; use committed_checkpoints()"
        )
    try:
        c = CheckpointCommit.model_validate(json.loads(data))
    except (ValueError, ValidationError) as e:
        raise ManifestError(
            f"{path} is malformed ({e}); delete checkpoint {k} and save it again"
        ) from e
    if c.iteration != k:
        raise ManifestError(
            f"{path} says iteration {c.iteration}, but its folder is {iter_name(k)}"
        )
    return c


def committed_checkpoints(fs: fsspec.AbstractFileSystem, ckpt_dir: str) -> list[int]:
    out = []
    for k in parse_iter_dirs(ls_names(fs, ckpt_dir)):
        try:
            read_commit(fs, ckpt_dir, k)
        except ManifestError:
            continue
        out.append(k)
    return out


class CheckpointWriter:
    """Writes one checkpoint: ``open(name)`` per file, then ``commit(meta)``.

    Writing into an already committed checkpoint only hashes (nothing is
    stored); ``commit`` is then a no-op for identical files and a
    VersionConflictError otherwise.
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        ckpt_dir: str,
        k: int,
        guard: Callable[[], None] | None = None,
    ):
        self.fs, self.k = fs, k
        # Called before deleting debris and before COMMIT: the writer's fence check.
        self._guard = guard or (lambda: None)
        self._ckpt_dir = ckpt_dir
        self._dir = join(ckpt_dir, iter_name(k))
        self._lock = threading.Lock()
        self._open: set[str] = set()
        self._done: dict[str, FileEntry] = {}
        self._paths: list[str] = []
        self._failed: str | None = None
        try:
            self._existing: CheckpointCommit | None = read_commit(fs, ckpt_dir, k)
        except ManifestError:
            self._existing = None
            self._guard()
            rm_tree(fs, self._dir)  # an uncommitted folder is debris of a failed save

    def open(self, name: str) -> HashingWriter:
        check_file_name(name, (COMMIT,))
        with self._lock:
            if name in self._open or name in self._done:
                raise StorageError(
                    f"checkpoint file {name!r} was already written; names must be unique"
                )
            self._open.add(name)
        path = join(self._dir, name)
        if self._existing is not None:
            w: HashingWriter = NullHashingWriter(name, self._closed)
        elif is_local(self.fs):
            w = LocalHashingWriter(name, path, self._closed)
            self._paths.append(path)
        else:
            w = S3HashingWriter(name, self.fs, path, self._closed)
        orig_abort = w.abort

        def abort() -> None:
            self._failed = self._failed or name
            orig_abort()

        w.abort = abort  # type: ignore[method-assign]
        return w

    def _closed(self, w: HashingWriter) -> None:
        assert w.sha256 is not None
        with self._lock:
            self._open.discard(w.name)
            self._done[w.name] = FileEntry(name=w.name, bytes=w.bytes, sha256=w.sha256)

    def commit(self, meta: dict[str, Any]) -> None:
        """Write COMMIT last. ``meta`` must be JSON-able (e.g. {"weights_version": 12})."""
        if self._failed:
            raise StorageError(
                f"checkpoint file {self._failed!r} failed while writing; checkpoint {self.k} was not committed"
            )
        if self._open:
            raise StorageError(f"checkpoint files {sorted(self._open)} were opened but not closed")
        files = tuple(sorted(self._done.values(), key=lambda f: f.name))
        if self._existing is not None:
            if {(f.name, f.bytes, f.sha256) for f in files} != {
                (f.name, f.bytes, f.sha256) for f in self._existing.files
            }:
                raise VersionConflictError(
                    f"checkpoint {self.k} is already committed with different files; "
                    "committed checkpoints are immutable: delete it first (gc) to save it again"
                )
            return
        for p in self._paths:
            _fsync(p)
        c = CheckpointCommit(iteration=self.k, created_at=time.time(), files=files, meta=meta)
        self._guard()
        write_bytes(self.fs, join(self._dir, COMMIT), dumps(c.model_dump(mode="json")))


def open_checkpoint_file(
    fs: fsspec.AbstractFileSystem, ckpt_dir: str, k: int, name: str
) -> VerifyingReader:
    c = read_commit(fs, ckpt_dir, k)
    entry = _entry(c, name, k)
    path = join(ckpt_dir, iter_name(k), name)
    size = fs.size(path)
    if size != entry.bytes:
        raise IntegrityError(
            f"checkpoint {k} file {name!r} has {size} bytes, COMMIT says {entry.bytes}; it is truncated or replaced"
        )
    return VerifyingReader(
        fs.open(path, "rb"), f"checkpoint {k} file {name!r}", entry.bytes, entry.sha256
    )


def verify_checkpoint(fs: fsspec.AbstractFileSystem, ckpt_dir: str, k: int) -> None:
    c = read_commit(fs, ckpt_dir, k)
    for entry in c.files:
        path = join(ckpt_dir, iter_name(k), entry.name)
        try:
            with fs.open(path, "rb") as f:
                n, sha = hash_stream(f)
        except FileNotFoundError:
            raise IntegrityError(
                f"checkpoint {k} file {entry.name!r} is missing; the checkpoint is corrupt"
            ) from None
        if n != entry.bytes or sha != entry.sha256:
            raise IntegrityError(
                f"checkpoint {k} file {entry.name!r}: {n} bytes sha256 {sha[:12]}..., COMMIT says "
                f"{entry.bytes} bytes sha256 {entry.sha256[:12]}...; the checkpoint is corrupt, resume from an older one"
            )


def _entry(c: CheckpointCommit, name: str, k: int) -> FileEntry:
    for f in c.files:
        if f.name == name:
            return f
    raise StorageError(f"checkpoint {k} has no file {name!r}; it has {[f.name for f in c.files]}")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
