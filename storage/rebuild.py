"""Rebuilding a delta version (``storage.delta``) into its full files, verified.

Owns the reader's side of deltas: which full file comes from where (stored
whole, XOR-decoded against the base, or the base's file as is), the checks that
the base is the one the delta was made from, and the check of every rebuilt
file against the size and hash tree recorded at publish. A wrong or missing
base, or a damaged delta, is an IntegrityError naming the version, the base,
the file and (with trees) the chunk; nothing half-rebuilt is ever left where a
loader looks (the caller rebuilds in a staging folder). Must not fetch anything:
the stored files and the base are already local and verified when it runs.

One pass: a file's frames are decoded on every core (``storage.tree.pool``) by the
reader of the manifest's codec (``storage.delta_format.CODECS``; the file's magic must
agree), each XORed into the base image, written at its offset and its chunks hashed
while they are in cache. A chunk whose XOR is all zero over base bytes at the same
offsets is the base's chunk: its hash is taken from the base's tree, once the base
file was verified in this process (``storage.tree.verified_once``). A delta
written before trees is checked by the sha256 of each rebuilt file, read again
once it is written.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all

import numpy as np

from storage import tree
from storage.delta_format import (
    CODECS,
    DELTA_SUFFIX,
    FRAME,
    TENSORS,
    DenseXor,
    SparseXor,
    read_mode,
    xor_into,
)
from storage.delta_image import MAX_HEADER, BaseImage, parse_layout, read_layout
from storage.errors import IntegrityError
from storage.hashio import hash_file, pwrite_all
from storage.layout import version_name
from storage.types import FileEntry, FileTree, WeightsManifest

# Files rebuilt at once; each one's frames run on the chunk pool (every core), so a
# second file only fills the gaps while the first one's last frames finish.
_THREADS = 2


def _who(m: WeightsManifest) -> str:
    assert m.delta is not None
    return f"{version_name(m.version)} (a delta of {version_name(m.delta.base)})"


def check_base(m: WeightsManifest, base: WeightsManifest | None) -> WeightsManifest:
    """The base manifest, once it is the very version ``m`` was made against."""
    assert m.delta is not None
    b = version_name(m.delta.base)
    if base is None:
        raise IntegrityError(
            f"{_who(m)}: its base {b} is missing (deleted or never committed); "
            f"republish {version_name(m.version)} full, or restore {b}"
        )
    if base.delta is not None:
        raise IntegrityError(
            f"{_who(m)}: {b} is itself a delta; a delta's base must be full. Republish "
            f"{version_name(m.version)}"
        )
    if base.digest() != m.delta.base_digest:
        raise IntegrityError(
            f"{_who(m)}: {b} is not the version it was made from (its files' digest "
            f"{base.digest()[:12]}... != {m.delta.base_digest[:12]}...: the base was republished "
            f"with other bytes); republish {version_name(m.version)}"
        )
    return base


def plan(m: WeightsManifest, base: WeightsManifest) -> dict[str, str]:
    """full file name -> "stored" | "xor" | "base", after checking that every stored
    file has a use and every "base" file is the base's identical file."""
    assert m.delta is not None
    stored_files = {f.name: f for f in m.files}
    stored = set(stored_files)
    base_files = {f.name: f for f in base.files}
    out: dict[str, str] = {}
    for e in m.delta.full:
        if e.name in stored:
            if stored_files[e.name] != e:  # pulls verify stored files: equal entries suffice
                raise IntegrityError(
                    f"{_who(m)}: {e.name!r} is stored whole but its stored and full entries "
                    f"differ; the manifest is damaged: republish {version_name(m.version)}"
                )
            out[e.name] = "stored"
        elif e.name + DELTA_SUFFIX in stored:
            if e.name not in base_files:
                raise IntegrityError(
                    f"{_who(m)}: {e.name!r} is stored as an XOR against the base, which has no "
                    f"such file; the base is wrong: republish {version_name(m.version)}"
                )
            out[e.name] = "xor"
        else:
            b = base_files.get(e.name)
            if b is None or (b.bytes, b.sha256) != (e.bytes, e.sha256):
                raise IntegrityError(
                    f"{_who(m)}: {e.name!r} should be the base's file as is, but the base "
                    f"{'has no such file' if b is None else 'holds other bytes'}; "
                    f"republish {version_name(m.version)}"
                )
            out[e.name] = "base"
    extra = stored - set(out) - {n + DELTA_SUFFIX for n, how in out.items() if how == "xor"}
    if extra:
        raise IntegrityError(
            f"{_who(m)}: stored files {sorted(extra)[:5]} rebuild nothing; the manifest is "
            f"damaged: republish {version_name(m.version)}"
        )
    return out


def rebuild_dir(stage: str, m: WeightsManifest, base_dir: str, base: WeightsManifest) -> None:
    """Turn ``stage`` (holding ``m.files``, verified) into the full files of
    ``m.delta.full``, each verified; the delta files are removed from it."""
    assert m.delta is not None
    how = plan(m, check_base(m, base))
    full = {e.name: e for e in m.delta.full}
    base_files = {e.name: e for e in base.files}
    jobs = [n for n, h in how.items() if h != "stored"]

    def one(n: str) -> None:
        if how[n] == "xor":
            _Decode(stage, base_dir, full[n], m, base_files.get(n)).run()
        else:
            _take_base(stage, base_dir, full[n], m)

    with ThreadPoolExecutor(max(1, min(_THREADS, len(jobs)))) as files:
        for f in [files.submit(one, n) for n in sorted(jobs, key=lambda n: -full[n].bytes)]:
            f.result()
    for n, h in how.items():
        if h == "xor":
            os.unlink(os.path.join(stage, n + DELTA_SUFFIX))


class _Buffers:
    """Pairs of frame buffers (the decoded XOR, the image that becomes the new bytes),
    reused across frames and rebuilds: fresh pages cost more than the XOR (first-touch
    faults). ``take`` waits while ``slots`` pairs are in use, which bounds the frames
    in flight across all files; that many pairs are kept."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._free: list[tuple[np.ndarray, np.ndarray]] = []
        self._lock = threading.Lock()
        self._sem = threading.Semaphore(slots)

    def take(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        self._sem.acquire()
        if size <= FRAME:
            with self._lock:
                if self._free:
                    return self._free.pop()
        n = max(size, FRAME)
        return np.empty(n, np.uint8), np.empty(n, np.uint8)

    def give(self, pair: tuple[np.ndarray, np.ndarray]) -> None:
        with self._lock:
            if len(pair[0]) == FRAME and len(self._free) < self.slots:
                self._free.append(pair)
        self._sem.release()


# Every core busy and one frame being read ahead, at most 16 (256 MiB) in flight.
_BUFFERS = _Buffers(min(tree.workers() + 2, 16))


class _Decode:
    """Rebuilds one file from its ``.xor.zst`` and its base file (see the module doc)."""

    def __init__(
        self, stage: str, base_dir: str, e: FileEntry, m: WeightsManifest, base_e: FileEntry | None
    ):
        assert m.delta is not None
        self.e, self.m, self.codec = e, m, m.delta.codec
        self.reader = CODECS[self.codec]
        self.src = os.path.join(stage, e.name + DELTA_SUFFIX)
        self.dst = os.path.join(stage, e.name)
        self.base_path = os.path.join(base_dir, e.name)
        self.where = f"{_who(m)} {e.name + DELTA_SUFFIX!r}"
        self.tree: FileTree | None = e.tree
        self.digests: list[bytes | None] = [None] * len(e.tree.hashes) if e.tree else []
        self.base_e = base_e
        self.base_tree = self._carry_from(base_e)
        self.image: BaseImage | None = None
        self.fd = -1
        self._write = threading.Lock()

    def _carry_from(self, b: FileEntry | None) -> FileTree | None:
        """The base's tree when its chunk hashes may stand for unchanged chunks: same
        chunk size, and the base file verified in this process."""
        t = self.tree
        if t is None or b is None or b.tree is None or b.tree.chunk != t.chunk:
            return None
        why = tree.verified_once(self.base_path, b)
        if why is not None:
            raise IntegrityError(
                f"{_who(self.m)}: its base's {b.name!r} in {os.path.dirname(self.base_path)}: "
                f"{why}; the cached base is damaged: pull it again (pull with "
                f"verify_cached), or republish {version_name(self.m.version)}"
            )
        return b.tree

    def run(self) -> None:
        futs: deque[tuple[Future, tuple[np.ndarray, np.ndarray]]] = deque()
        off = 0
        self.fd = os.open(self.dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with open(self.src, "rb") as f:
                mode = read_mode(f, self.codec, self.where)
                for c, size in self.reader.frames(f, self.where, FRAME + MAX_HEADER):
                    self._check_frame(off, size)
                    pair = _BUFFERS.take(size)  # waits while every slot is in flight
                    job: bytes | None = c
                    if self.image is None:  # the first frame's header tells the image
                        try:
                            self.reader.xor(c, pair[0][:size], pair[1], self.where)
                            self.image = _image(
                                mode, pair[0][:size], self.base_path, self.e, self.m
                            )
                        except BaseException:
                            _BUFFERS.give(pair)
                            raise
                        job = None
                    futs.append((tree.pool().submit(self._frame, job, pair, off, size), pair))
                    off += size
                    while futs and futs[0][0].done():
                        futs.popleft()[0].result()
            while futs:
                futs.popleft()[0].result()
        finally:
            for fut, pair in futs:
                if fut.cancel():
                    _BUFFERS.give(pair)
            wait_all([fut for fut, _ in futs])  # no frame may still use the file or image
            os.close(self.fd)
            if self.image is not None:
                self.image.close()
        if off != self.e.bytes:
            raise IntegrityError(
                f"{self.where} decodes to {off} bytes, {self.e.name!r} has {self.e.bytes}; "
                f"the delta is damaged: republish {version_name(self.m.version)}"
            )
        self._verify()

    def _check_frame(self, off: int, size: int) -> None:
        if off + size > self.e.bytes:
            raise IntegrityError(
                f"{self.where} decodes to more than the {self.e.bytes} bytes of "
                f"{self.e.name!r}; the delta is damaged: republish {version_name(self.m.version)}"
            )
        t = self.tree
        if t is not None and (off % t.chunk or size % t.chunk and off + size != self.e.bytes):
            raise IntegrityError(
                f"{self.where}: a frame of {size} bytes at byte {off} does not line up with "
                f"the {t.chunk}-byte chunks of its tree; the delta is damaged: republish "
                f"{version_name(self.m.version)}"
            )

    def _frame(
        self, c: bytes | None, pair: tuple[np.ndarray, np.ndarray], off: int, size: int
    ) -> None:
        """Decode one frame (``c``; None: its XOR already in ``pair[0]``) into the image
        read into ``pair[1]``, write it, and hash (or carry) its chunks while they are
        in cache."""
        assert self.image is not None
        try:
            new = self.image.read_into(off, pair[1][:size])
            changes: DenseXor | SparseXor
            if c is None:
                xor_into(new, pair[0][:size])
                changes = DenseXor(pair[0][:size])
            else:
                changes = self.reader.apply(c, new, pair[0], self.where)
            with self._write:  # writers of one file would only spin on its inode lock
                pwrite_all(self.fd, memoryview(new), off)
            if self.tree is not None:
                step = self.tree.chunk
                for lo in range(0, size, step):
                    hi = min(lo + step, size)
                    k = (off + lo) // step
                    if self._unchanged(k, off + lo, off + hi) and changes.zero(lo, hi):
                        assert self.base_tree is not None
                        self.digests[k] = bytes.fromhex(self.base_tree.hashes[k])
                    else:
                        self.digests[k] = tree.digest(new[lo:hi])
        finally:
            _BUFFERS.give(pair)

    def _unchanged(self, k: int, lo: int, hi: int) -> bool:
        """Chunk k ([lo, hi)) is the base's chunk k if its XOR is zero: the same span of
        the base file, read as is (no zero fill, no move)."""
        b = self.base_tree
        if b is None or self.base_e is None or k >= len(b.hashes):
            return False
        if min(lo + b.chunk, self.base_e.bytes) != hi:
            return False
        assert self.image is not None
        return self.image.identical(lo, hi)

    def _verify(self) -> None:
        e, m = self.e, self.m
        assert m.delta is not None
        if self.tree is not None:
            why = (
                "a chunk was never written"
                if any(d is None for d in self.digests)
                else tree.problem(e, self.digests)  # type: ignore[arg-type]
            )
        else:  # written before trees: the sha256 of the whole file
            n, sha = hash_file(self.dst)
            why = None
            if (n, sha) != (e.bytes, e.sha256):
                why = (
                    f"sha256 {sha[:12]}... ({n} bytes), the manifest says sha256 "
                    f"{e.sha256[:12]}... ({e.bytes} bytes)"
                )
        if why is not None:
            raise IntegrityError(
                f"{_who(m)}: rebuilt {e.name!r}: {why}: the delta or its base "
                f"{version_name(m.delta.base)} is damaged; re-pull the base, or republish "
                f"{version_name(m.version)}"
            )


def _image(
    mode: bytes, first: np.ndarray, base_path: str, e: FileEntry, m: WeightsManifest
) -> BaseImage:
    if mode != TENSORS:
        return BaseImage.raw(base_path)
    # The image is zero over the header, so the first frame holds the header as is.
    new = parse_layout(memoryview(first))
    base = read_layout(base_path)
    if new is None or base is None:
        raise IntegrityError(
            f"{_who(m)}: {e.name + DELTA_SUFFIX!r} says tensor-aligned, but "
            f"{'its header' if new is None else 'the base file'} is not safetensors; "
            f"the delta or the base is damaged: republish {version_name(m.version)}"
        )
    return BaseImage.tensors(base_path, base, new)


def _take_base(stage: str, base_dir: str, e: FileEntry, m: WeightsManifest) -> None:
    src, dst = os.path.join(base_dir, e.name), os.path.join(stage, e.name)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.link(src, dst)  # the cache's files are never written in place (storage.pull)
    except OSError:
        shutil.copyfile(src, dst)
    # A link is the base file itself: checked once per process (tree.verified_once).
    why = tree.verified_once(dst, e)
    if why is not None:
        raise IntegrityError(
            f"{_who(m)}: {e.name!r} (taken from the base): {why}; re-pull, or republish "
            f"{version_name(m.version)}"
        )
