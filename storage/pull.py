"""Pull a committed weight version into a local cache folder, verified.

Owns the reader side of the commit protocol: only versions with a valid
manifest are pulled; each file is hashed while it streams in (its tree's chunks on
every core, or its sha256 when its entry predates trees) and re-fetched on a
mismatch; the cache folder appears (by rename) only when complete, with the
manifest copied last. Must never write outside ``cache_dir/.tmp-*`` and
``cache_dir/v000012``.

One pull per machine: a pull holds an flock on the cache folder itself, so
engines of one node that reload at once copy a version once; the others wait
and reuse the copy. The lock ends with its process, so a killed puller never
blocks the next one.

From a local root on the same filesystem as the cache, a file is hard-linked
instead of copied (as ``git clone --local`` does with its immutable objects),
then verified by reading it. This is safe because committed files are never
written in place: publishing writes a staging folder and renames it, a
republish only hashes, and gc unlinks (the cache keeps its link). The one writer
of cache files is this module, and it unlinks a file before every attempt, so it
can never write through a link into a committed version. Trade-off: the cache
is then the same bytes on disk as the version, not a second copy of them.

A delta version (``storage.delta``) is pulled as its base first (into the same
cache, verified, reused by every delta of it), then its stored files, then
rebuilt in the staging folder (``storage.rebuild``: every full file checked
against the tree recorded at publish); the folder that appears is a full HF
folder whose manifest lists the full files, so loaders never see a delta.
"""

from __future__ import annotations

import fcntl
import logging
import os
import posixpath
import shutil
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import fsspec

from storage import tree
from storage.errors import IntegrityError, ManifestError, StorageError
from storage.fs import dumps, is_local, join, read_bytes
from storage.hashio import READ_CHUNK, LocalHashingWriter
from storage.integrity import verify_dir
from storage.layout import MANIFEST, TMP_PREFIX, version_name
from storage.manifests import parse_manifest
from storage.rebuild import check_base, rebuild_dir
from storage.types import FileEntry, Pulled, WeightsManifest

log = logging.getLogger("storage")

# Ranged GETs per S3 request; several are kept in flight per file.
_RANGE = 16 << 20


def pull_version(
    fs: fsspec.AbstractFileSystem,
    version_dir: str,
    manifest: WeightsManifest,
    cache_dir: str,
    workers: int = 8,
    retries: int = 3,
    verify_cached: bool = False,
) -> Pulled:
    """Make ``cache_dir/v000012`` a verified copy of ``manifest``'s files; what it took.

    A complete cached copy is reused after a size check; with ``verify_cached`` it is
    also hashed (``verify_dir``) and pulled again when its bytes changed, which is the
    fix for a loader whose ``verify_dir`` refused the cache. ``cache_dir`` may start
    with ``~``: it is expanded here, on the machine that pulls."""
    t0 = time.perf_counter()
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir))
    os.makedirs(cache_dir, exist_ok=True)
    with _locked(cache_dir):
        copied = _ensure(fs, version_dir, manifest, cache_dir, workers, retries, verify_cached)
    return Pulled(
        path=os.path.join(cache_dir, version_name(manifest.version)),
        copied=copied,
        bytes=manifest.rebuilt().total_bytes(),
        seconds=time.perf_counter() - t0,
        base=manifest.delta.base if manifest.delta is not None else None,
    )


def _ensure(
    fs: fsspec.AbstractFileSystem,
    version_dir: str,
    manifest: WeightsManifest,
    cache_dir: str,
    workers: int,
    retries: int,
    verify_cached: bool,
) -> bool:
    """Make ``cache_dir/v000012`` the version's full files (a delta: its base first,
    then rebuilt from it); False when a complete copy was already there."""
    dest = os.path.join(cache_dir, version_name(manifest.version))
    if _reusable(dest, manifest.rebuilt(), verify_cached):
        return False
    base: tuple[str, WeightsManifest] | None = None
    if manifest.delta is not None:
        base_dir = posixpath.join(
            posixpath.dirname(version_dir.rstrip("/")), version_name(manifest.delta.base)
        )
        base_m = check_base(manifest, _read_base(fs, base_dir, manifest.delta.base))
        _ensure(fs, base_dir, base_m, cache_dir, workers, retries, verify_cached)
        base = (os.path.join(cache_dir, version_name(base_m.version)), base_m)
    _pull_into(fs, version_dir, manifest, cache_dir, dest, workers, retries, base)
    return True


def _read_base(fs: fsspec.AbstractFileSystem, base_dir: str, base: int) -> WeightsManifest | None:
    path = join(base_dir, MANIFEST)
    data = read_bytes(fs, path)
    return None if data is None else parse_manifest(data, path, base)


@contextmanager
def _locked(folder: str) -> Iterator[None]:
    """An exclusive flock on the (local) folder itself for the block: no lock file to
    leave behind, and dropped if its process dies."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _reusable(dest: str, manifest: WeightsManifest, verify_cached: bool) -> bool:
    if not _cache_ok(dest, manifest):
        return False
    if not verify_cached:
        return True
    try:
        verify_dir(dest)
        return True
    except StorageError as e:
        log.warning("cached copy %s is damaged (%s); pulling it again", dest, e)
        return False


def _pull_into(
    fs: fsspec.AbstractFileSystem,
    version_dir: str,
    manifest: WeightsManifest,
    cache_dir: str,
    dest: str,
    workers: int,
    retries: int,
    base: tuple[str, WeightsManifest] | None = None,
) -> None:
    stage = os.path.join(
        cache_dir, f"{TMP_PREFIX}{version_name(manifest.version)}-{uuid.uuid4().hex}"
    )
    os.makedirs(stage)
    try:
        files = sorted(manifest.files, key=lambda f: -f.bytes)  # big first: better overlap
        n = max(1, min(workers, len(files)))
        with (
            ThreadPoolExecutor(n, thread_name_prefix="storage-pull") as files_pool,
            ThreadPoolExecutor(max(2, workers), thread_name_prefix="storage-range") as range_pool,
        ):
            futs = [
                files_pool.submit(
                    _pull_file, fs, version_dir, f, stage, retries, range_pool, workers
                )
                for f in files
            ]
            for fut in futs:
                fut.result()
        if base is not None:  # a delta: its stored files are verified; rebuild and verify
            rebuild_dir(stage, manifest, *base)
        # The manifest goes in last, so a folder with a manifest is a complete folder.
        # A rebuilt delta's lists its full files: loaders verify the folder against it.
        with open(os.path.join(stage, MANIFEST), "wb") as out:
            out.write(dumps(manifest.rebuilt().dump()))
        if os.path.exists(dest):
            shutil.rmtree(dest)  # an incomplete/stale copy of this very version
        # No fsync: this is a cache. After a crash a copy is reused only if its manifest
        # and every file size match; anything else is pulled again.
        os.rename(stage, dest)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _cache_ok(dest: str, manifest: WeightsManifest) -> bool:
    """A cached copy is reused when it carries the same manifest and every size matches
    (its sha256 was verified while it was pulled)."""
    path = os.path.join(dest, MANIFEST)
    if not os.path.exists(path):
        return False
    try:
        with open(path, "rb") as f:
            cached = parse_manifest(f.read(), path, manifest.version)
    except ManifestError:
        return False
    if cached.file_set() != manifest.file_set():
        return False
    for f in manifest.files:
        p = os.path.join(dest, f.name)
        if not os.path.isfile(p) or os.path.getsize(p) != f.bytes:
            return False
    return True


def _pull_file(
    fs: fsspec.AbstractFileSystem,
    version_dir: str,
    entry: FileEntry,
    stage: str,
    retries: int,
    range_pool: ThreadPoolExecutor,
    lookahead: int,
) -> None:
    src = join(version_dir, entry.name)
    dst = os.path.join(stage, entry.name)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    last = ""
    for _attempt in range(1 + retries):
        # A failed attempt may have left a hard link to the committed file here;
        # writing into it would change the committed version.
        _unlink(dst)
        try:
            actual = fs.size(src)
        except FileNotFoundError:
            last = "it is missing from the version folder"
            continue
        if actual != entry.bytes:
            # Checked before downloading: a truncated object would only waste a transfer.
            last = f"it has {actual} bytes, manifest says {entry.bytes}"
            continue
        why = _copy_checked(fs, src, dst, entry, range_pool, lookahead)
        if why is None:
            tree.remember(dst, entry)  # a delta's rebuild trusts this base file's tree
            return
        last = why
    raise IntegrityError(
        f"{entry.name} of {version_dir} failed verification {1 + retries} times ({last}); "
        "the stored version is corrupt: republish it or roll engines back to another version"
    )


def _copy_checked(
    fs: fsspec.AbstractFileSystem,
    src: str,
    dst: str,
    entry: FileEntry,
    pool: ThreadPoolExecutor,
    lookahead: int,
) -> str | None:
    """Put ``src`` at ``dst`` (which must not exist); None when its bytes are
    ``entry``'s, else what differs. Checked by the entry's tree (its chunks hashed on
    every core) or, for an entry written before trees, by its sha256."""
    if is_local(fs) and _try_link(src, dst):
        # Costs no copy; verification still reads every byte (of the very file served).
        return tree.check_local(dst, entry)
    size = entry.bytes
    chunks = _local_chunks(src) if is_local(fs) else _remote_chunks(fs, src, size, pool, lookahead)
    # The hashing writer overlaps the hashes of a piece with writing it to the cache.
    t = entry.tree
    out = LocalHashingWriter(
        os.path.basename(dst),
        dst,
        writeback=False,  # a cache: no fsync
        sha=t is None,
        chunks=None if t is None else t.chunk,
    )
    try:
        for chunk in chunks:
            out.write(chunk)
    except BaseException:
        out.abort()
        raise
    out.close()
    if out.bytes != size:
        return f"got {out.bytes} bytes, the manifest says {size}"
    if out.digests is not None:
        return tree.problem(entry, out.digests)
    if out.sha256 != entry.sha256:
        return f"got sha256 {str(out.sha256)[:12]}..., the manifest says {entry.sha256[:12]}..."
    return None


def _try_link(src: str, dst: str) -> bool:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem (EXDEV), links not allowed (EPERM), too many (EMLINK)
        return False
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _local_chunks(src: str) -> Iterator[memoryview]:
    with open(src, "rb", buffering=0) as f:
        buf = bytearray(READ_CHUNK)
        view = memoryview(buf)
        while k := f.readinto(buf):
            yield view[:k]


def _remote_chunks(
    fs: fsspec.AbstractFileSystem, src: str, size: int, pool: ThreadPoolExecutor, lookahead: int
) -> Iterator[bytes]:
    """In-order chunks of ``src`` fetched by concurrent ranged GETs (``size`` was checked)."""
    if size == 0:
        return
    starts = list(range(0, size, _RANGE))
    pending: list[Future] = []
    it = iter(starts)

    def fill() -> None:
        while len(pending) < max(1, lookahead):
            s = next(it, None)
            if s is None:
                return
            pending.append(pool.submit(fs.cat_file, src, start=s, end=min(s + _RANGE, size)))

    fill()
    while pending:
        data = pending.pop(0).result()
        fill()
        if data:
            yield data
