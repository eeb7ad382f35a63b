"""Hash trees of weight files, and checking local files against their manifest entries.

A file's tree (``FileTree`` in a manifest entry) is the BLAKE3 hash of each fixed-size
chunk (``CHUNK`` bytes, the last one shorter) and a root over them. The chunks are
hashed on a pool of one thread per core (BLAKE3 releases the GIL), so a reader
verifies a file at the speed of all cores, not of one sequential sha256 pass, and a
damaged chunk is named by its index and byte range. The root binds the file's size,
its sha256 and the chunk hashes together: a reader that checked every chunk and the
root has checked every field of the entry, sha256 included, without computing it.
Entries written before trees existed carry only the sha256; those are checked with
one sha256 pass, as they always were.

Also owns the record of files this process verified (or wrote) against an entry:
committed files never change in place, so one check per process is enough while a
file's device, inode, size and mtime stay the same (``verified_once``). A delta's
rebuild takes the hashes of unchanged chunks from such a base file's tree.

Must not decide what is trusted beyond that record, nor read anything but local
files and streams handed to it.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

from storage.errors import StorageError
from storage.types import FileEntry, FileTree

try:
    from blake3 import blake3 as _blake3
except ImportError:  # a dependency of the project; named for a hand-made environment
    _blake3 = None

# Bytes per chunk: also a delta's frame (storage.delta_format.FRAME), so a rebuild
# hashes each chunk as it writes it. 8 MiB: a 1 GB shard is 120 chunks, enough to
# keep every core busy, and a 0.5B model's manifest stays under 20 KB.
CHUNK = 8 << 20
_READ = 8 << 20  # bytes per read of the sha256-only check
_DOMAIN = b"prefect-rl file tree 1\0"

_POOL_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None


def workers() -> int:
    """Threads of the chunk pool: one per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def pool() -> ThreadPoolExecutor:
    """The pool chunk hashes run on. Its tasks never wait for other tasks of it, so
    any thread (one of another pool included) may submit to it and wait."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(workers(), thread_name_prefix="storage-chunk")
        return _POOL


def new_hasher() -> Any:
    if _blake3 is None:
        raise StorageError(
            "weight manifests hash chunks with BLAKE3, which needs the blake3 package; "
            "pip install blake3"
        )
    return _blake3()


def digest(data: Any) -> bytes:
    """The BLAKE3 hash of one chunk's bytes."""
    h = new_hasher()
    h.update(data)
    return h.digest()


def n_chunks(size: int, chunk: int) -> int:
    return -(-size // chunk)


def root_of(size: int, sha256: str, chunk: int, digests: Sequence[bytes]) -> str:
    """BLAKE3 over the size, the chunk size, the file's sha256 and the chunk hashes."""
    h = new_hasher()
    h.update(_DOMAIN + struct.pack("<QQ", size, chunk) + bytes.fromhex(sha256))
    h.update(b"".join(digests))
    return h.hexdigest()


def make(size: int, sha256: str, digests: Sequence[bytes], chunk: int = CHUNK) -> FileTree:
    return FileTree(
        chunk=chunk,
        hashes=tuple(d.hex() for d in digests),
        root=root_of(size, sha256, chunk, digests),
    )


def problem(entry: FileEntry, digests: Sequence[bytes]) -> str | None:
    """None when ``digests`` (hashed from a file of ``entry.bytes`` bytes) are the
    entry's tree; else what differs: the first damaged chunk, or the root."""
    t = entry.tree
    assert t is not None
    if len(digests) != len(t.hashes):
        return f"{len(digests)} chunks were hashed, its tree lists {len(t.hashes)}"
    for i, (got, want) in enumerate(zip(digests, t.hashes)):
        if got.hex() != want:
            lo = i * t.chunk
            hi = min(lo + t.chunk, entry.bytes)
            return (
                f"chunk {i} of {len(t.hashes)} (bytes {lo}-{hi}) hashes to {got.hex()[:12]}..., "
                f"the manifest says {want[:12]}..."
            )
    root = root_of(entry.bytes, entry.sha256, t.chunk, digests)
    if root != t.root:
        return (
            f"its chunks match, but the manifest's root {t.root[:12]}... is not the root "
            f"{root[:12]}... of its size, sha256 and chunk hashes (the manifest is damaged)"
        )
    return None


class ChunkHasher:
    """Chunk hashes of a stream of bytes. ``feed`` hands each chunk's share of a
    buffer to the pool and returns the futures: wait for them before the buffer is
    reused or fed again (each chunk's bytes must reach its hasher in order)."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self._hashers: list[Any] = []
        self._fill = chunk  # bytes in the last chunk: full, so the first feed opens one

    def feed(self, mv: memoryview) -> list[Future]:
        futs, i, n = [], 0, mv.nbytes
        while i < n:
            if self._fill == self.chunk:
                self._hashers.append(new_hasher())
                self._fill = 0
            take = min(self.chunk - self._fill, n - i)
            futs.append(pool().submit(self._hashers[-1].update, mv[i : i + take]))
            self._fill += take
            i += take
        return futs

    def digests(self) -> list[bytes]:
        return [h.digest() for h in self._hashers]


def _pread_digest(fd: int, off: int, n: int) -> bytes:
    buf = _local_buffer(n)
    view = memoryview(buf)[:n]
    got = 0
    while got < n:
        k = os.preadv(fd, [view[got:]], off + got)
        if k == 0:
            raise EOFError(f"file ended at byte {off + got}")
        got += k
    return digest(view)


_TLS = threading.local()


def _local_buffer(n: int) -> bytearray:
    """One reused buffer per pool thread: fresh pages cost more than the hash."""
    buf = getattr(_TLS, "buf", None)
    if buf is None or len(buf) < n:
        buf = _TLS.buf = bytearray(n)
    return buf


def fd_digests(fd: int, size: int, chunk: int) -> list[Future]:
    """Futures of the chunk hashes of an open local file's first ``size`` bytes,
    read and hashed on the pool (the fd must stay open until they are done)."""
    return [
        pool().submit(_pread_digest, fd, off, min(chunk, size - off))
        for off in range(0, size, chunk)
    ]


def buffer_digests(mv: memoryview, chunk: int) -> list[bytes]:
    """The chunk hashes of a buffer (a mapped file), hashed on the pool."""
    futs = [pool().submit(digest, mv[off : off + chunk]) for off in range(0, mv.nbytes, chunk)]
    return [f.result() for f in futs]


def stream_digests(f: BinaryIO, chunk: int) -> tuple[int, list[bytes]]:
    """(bytes, chunk hashes) of everything readable from ``f``, read in order and
    hashed on the pool with up to one chunk per core in flight."""
    futs: list[Future] = []
    n, out = 0, []
    while data := _read_full(f, chunk):
        n += len(data)
        futs.append(pool().submit(digest, data))
        if len(futs) > workers():
            out.append(futs.pop(0).result())
    return n, out + [x.result() for x in futs]


def _read_full(f: BinaryIO, n: int) -> bytes:
    parts, got = [], 0
    while got < n and (data := f.read(n - got)):
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def check_fd(fd: int, size: int, entry: FileEntry) -> str | None:
    """None when the open local file (of ``size`` bytes) matches ``entry``; else what
    differs. By its tree when the entry has one, else by one sha256 pass."""
    if size != entry.bytes:
        return f"has {size} bytes, the manifest says {entry.bytes} (truncated or replaced)"
    if entry.tree is not None:
        try:
            got = [x.result() for x in fd_digests(fd, size, entry.tree.chunk)]
        except EOFError as e:
            return f"changed while it was read ({e})"
        return problem(entry, got)
    sha, buf, off = hashlib.sha256(), bytearray(_READ), 0
    view = memoryview(buf)
    while k := os.preadv(fd, [view], off):
        sha.update(view[:k])
        off += k
    if off != entry.bytes or sha.hexdigest() != entry.sha256:
        return (
            f"sha256 {sha.hexdigest()[:12]}... ({off} bytes), the manifest says sha256 "
            f"{entry.sha256[:12]}... ({entry.bytes} bytes): the bytes changed"
        )
    return None


def check_local(path: str, entry: FileEntry) -> str | None:
    """``check_fd`` of a local path; a missing file is a problem too. A problem reads
    after "<file>: " (callers name the file, its folder and the fix)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return "missing"
    try:
        return check_fd(fd, os.fstat(fd).st_size, entry)
    finally:
        os.close(fd)


# (device, inode, size, mtime_ns) -> sha256 of the entry a local file was verified
# against (or written as) by this process.
_VERIFIED: dict[tuple[int, int, int, int], str] = {}
_VERIFIED_LOCK = threading.Lock()


def _key(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def remember(path: str, entry: FileEntry) -> None:
    """Record that ``path`` holds ``entry``'s bytes (just verified, or just written and
    hashed by this process). Any later write changes its mtime or inode."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if st.st_size == entry.bytes:
        with _VERIFIED_LOCK:
            _VERIFIED[_key(st)] = entry.sha256


def verified_once(path: str, entry: FileEntry) -> str | None:
    """``check_local``, skipped when this process already verified the same file (same
    device, inode, size and mtime) against an entry of the same sha256."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "missing"
    with _VERIFIED_LOCK:
        sha = _VERIFIED.get(_key(st))
    if sha is not None:
        return None if sha == entry.sha256 else "not the file its manifest lists"
    why = check_local(path, entry)
    if why is None:
        remember(path, entry)
    return why
