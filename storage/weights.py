"""Weight versions: ``weights/v000012/`` holding HF files plus ``manifest.json``.

Owns the publish side (``WeightsWriter``) and reading/validating manifests. The
commit rule: a version exists for readers iff its manifest exists and parses.
Local disk: files go to a staging folder, are fsynced, the manifest is written
and fsynced, then the folder is renamed into place. S3: files are uploaded to
the version prefix, then the manifest PUT commits. Must never modify a
committed version.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import fsspec
from pydantic import ValidationError

from storage.errors import ManifestError, StorageError, VersionConflictError
from storage.fs import dumps, fsync_dir, is_local, join, ls_names, read_bytes, rm_tree, write_bytes
from storage.hashio import (
    READ_CHUNK,
    HashingWriter,
    LocalHashingWriter,
    NullHashingWriter,
    S3HashingWriter,
)
from storage.layout import MANIFEST, TMP_PREFIX, check_file_name, parse_version, version_name
from storage.types import FileEntry, WeightsManifest


def parse_manifest(data: bytes | None, where: str, version: int | None = None) -> WeightsManifest:
    """Validate manifest bytes; every failure is a ManifestError naming ``where``."""
    if data is None:
        raise ManifestError(
            f"{where} is missing: the version was never committed (or is being deleted)"
        )
    try:
        raw = json.loads(data)
    except ValueError as e:
        raise ManifestError(f"{where} is not valid JSON ({e}); republish the version") from e
    try:
        m = WeightsManifest.model_validate(raw)
    except ValidationError as e:
        raise ManifestError(
            f"{where} is invalid: {e.errors()[0]['msg']} ({e.error_count()} errors); republish the version"
        ) from e
    if version is not None and m.version != version:
        raise ManifestError(
            f"{where} says version {m.version}, but its folder is {version_name(version)}"
        )
    return m


def read_manifest(fs: fsspec.AbstractFileSystem, weights_dir: str, version: int) -> WeightsManifest:
    path = join(weights_dir, version_name(version), MANIFEST)
    return parse_manifest(read_bytes(fs, path), path, version)


def committed_versions(fs: fsspec.AbstractFileSystem, weights_dir: str) -> list[int]:
    """Versions whose manifest exists and parses; torn or staging folders are skipped."""
    found = {v: n for n in ls_names(fs, weights_dir) if (v := parse_version(n)) is not None}
    if not found:
        return []
    paths = {join(weights_dir, n, MANIFEST): v for v, n in found.items()}
    # One concurrent batch on S3 instead of a GET per version.
    blobs = fs.cat(list(paths), on_error="return")
    by_name = {k.rstrip("/").rsplit("/", 2)[-2]: b for k, b in blobs.items()}
    out = []
    for path, v in paths.items():
        data = by_name.get(version_name(v))
        if isinstance(data, bytes):
            try:
                parse_manifest(data, path, v)
            except ManifestError:
                continue
            out.append(v)
    return sorted(out)


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
        try:
            self._existing: WeightsManifest | None = read_manifest(fs, weights_dir, version)
        except ManifestError:
            self._existing = None
        if self._existing is not None:
            self._stage = ""
        elif self._local:
            self._stage = join(
                weights_dir, f"{TMP_PREFIX}{version_name(version)}-{uuid.uuid4().hex}"
            )
            os.makedirs(self._stage)
        else:
            # Leftovers of an earlier failed attempt are invisible (no manifest) but would mix in.
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
            if name in self._open or name in self._done:
                raise StorageError(
                    f"file {name!r} was already written to {version_name(self.version)}; names must be unique"
                )
            if self._existing is not None:
                w: HashingWriter = NullHashingWriter(name, self._closed)
            elif self._local:
                w = LocalHashingWriter(name, join(self._stage, name), self._closed)
            else:
                w = S3HashingWriter(
                    name,
                    self.fs,
                    join(self._stage, name),
                    self._closed,
                    max_inflight=self._inflight,
                )
            self._open[name] = w
        orig_abort = w.abort

        def abort() -> None:  # a file that failed mid-write poisons the whole version
            self._failed = self._failed or name
            orig_abort()

        w.abort = abort  # type: ignore[method-assign]
        return w

    def _closed(self, w: HashingWriter) -> None:
        assert w.sha256 is not None
        with self._lock:
            self._open.pop(w.name, None)
            self._done[w.name] = FileEntry(name=w.name, bytes=w.bytes, sha256=w.sha256)
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

    def commit(self) -> WeightsManifest:
        """Write manifest.json last (the commit) and return it."""
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
                return self._same_or_conflict(self._existing)
            m = WeightsManifest(
                version=self.version,
                run=self.run,
                iteration=self.iteration,
                parent=self.parent,
                created_at=time.time(),
                files=tuple(sorted(self._done.values(), key=lambda f: f.name)),
            )
            if self._local:
                return self._commit_local(m)
            write_bytes(self.fs, join(self._final, MANIFEST), dumps(m.model_dump(mode="json")))
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
        _write_fsynced(join(self._stage, MANIFEST), dumps(m.model_dump(mode="json")))
        fsync_dir(self._stage)
        if os.path.isdir(self._final):
            try:
                existing = read_manifest(self.fs, self._weights_dir, self.version)
            except ManifestError:
                shutil.rmtree(self._final)  # torn leftover (e.g. an interrupted gc): not a version
            else:  # someone committed meanwhile
                self._cleanup()
                return self._same_or_conflict(existing, m)
        os.rename(self._stage, self._final)
        fsync_dir(self._weights_dir)
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
        if self._local and self._stage:
            shutil.rmtree(self._stage, ignore_errors=True)
        # On S3 partial objects stay invisible (no manifest); the next attempt or gc removes them.

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
