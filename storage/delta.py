"""Publishing a weight version as a delta of an earlier full version.

``DeltaWriter`` has the surface of ``WeightsWriter`` (``open``, ``add_file``,
``commit``, ``abort``) and wraps one: a file the base also holds is streamed
through an XOR against the base's bytes into ``<name>.xor.zst``, encoded by
``storage.delta_format`` (codec ``xor-words``) one frame per chunk, the frames of a
file on every core (the chunk pool) and written in file order; a file equal to the
base's is not stored at all; any other file is stored whole. The manifest names the
base, its digest, and every rebuilt file's full size, sha256 and hash tree
(``storage.tree``; hashed from the new bytes as they stream in, but for the tree's
chunks the step left as the base's, whose hashes are the checked base's), so a
reader verifies what it rebuilds, never what it was told.

The base is a full version (never a delta: chains stay one link long), chosen by
``choose_base``: the newest committed full version fewer than ``full_every``
versions back; else the version is written full. The base's bytes come from a
local folder: the committed folder on a local root, or a verified pull into a
cache on an object store (once per base, reused by every delta against it).
Each base file is checked against the base's manifest before its first use in
this process (by its tree, on every core), so a changed base fails the publish
instead of writing a delta nobody can rebuild.

The commit rule is ``WeightsWriter``'s: files first, the manifest last; an
exception anywhere abandons the whole writer. Must not import torch.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from typing import Any

import fsspec
import numpy as np

from storage import tree
from storage.delta_format import (
    CODEC,
    DELTA_SUFFIX,
    FRAME,
    RAW,
    TENSORS,
    FrameWriter,
    encode,
    first_frame,
    is_zero,
    xor_into,
)
from storage.delta_image import BaseImage, header_size, parse_layout, read_layout
from storage.errors import IntegrityError, ManifestError, StorageError
from storage.hashio import HashingWriter, hash_file, wait
from storage.layout import version_name
from storage.manifests import committed_versions, read_manifest
from storage.types import DeltaOf, FileEntry, WeightsManifest
from storage.weights import WeightsWriter

# Frames in flight (encoding, or encoded and not yet written), each holding its 8 MiB
# buffer: one per core and two queued, at most 16 (128 MiB), shared by the files being
# written at once (shards are written in parallel), each keeping at least 2.
AHEAD = min(tree.workers() + 2, 16)
_LIVE_LOCK = threading.Lock()
_LIVE = [0]  # _XorFile objects open in this process


def _ahead() -> int:
    """Frames one open file may keep in flight now."""
    with _LIVE_LOCK:
        return max(2, AHEAD // max(1, _LIVE[0]))


def choose_base(
    fs: fsspec.AbstractFileSystem, weights_dir: str, version: int, full_every: int
) -> WeightsManifest | None:
    """The manifest of the full version ``version`` is a delta of, or None when it
    must be full: no committed full version within the last ``full_every - 1``."""
    if full_every <= 1:
        return None
    for v in reversed(committed_versions(fs, weights_dir)):
        if v >= version:
            continue
        if version - v >= full_every:
            return None
        try:
            m = read_manifest(fs, weights_dir, v)
        except ManifestError:
            continue
        if m.delta is None:
            return m
    return None


def remember_committed(m: WeightsManifest, folder: str) -> None:
    """Record the files of full version ``m``, just committed into the local ``folder``
    by this process, as verified (``storage.tree.remember``): their hashes were taken
    from the very bytes written (storage.hashio), so the first delta against this base
    need not read them again."""
    if m.delta is None:
        for e in m.files:
            tree.remember(os.path.join(folder, e.name), e)


def verify_base_file(path: str, entry: FileEntry, base: int, version: int) -> None:
    """IntegrityError unless the local base file matches ``entry`` (checked once per
    process while its inode, size and mtime stay the same: ``tree.verified_once``)."""
    why = tree.verified_once(path, entry)
    if why is not None:
        raise IntegrityError(
            f"base {version_name(base)} of {version_name(version)}: {entry.name!r} in "
            f"{os.path.dirname(path)}: {why}; re-pull or republish the base, or publish "
            f"{version_name(version)} full"
        )


class _XorFile(HashingWriter):
    """A file of the new version, written as frames of (new XOR base image) into
    ``inner``; its own sha256, tree and size are those of the full new bytes. Frames
    line up with the tree's chunks (``delta_format``): the bytes of a frame are XORed
    into its buffer as they arrive; once full, it is encoded on the chunk pool (an
    encode waits for no other task: the pool's contract) while the next one fills, and
    written when its turn comes, so an error in an encode surfaces in ``write`` or
    ``close`` and aborts the file.

    A chunk the step left as the base's (a zero XOR over the base file's own bytes at
    the same offsets) takes its hash from the base's tree, which ``DeltaWriter.open``
    checked first, instead of being hashed again. So each piece is XORed before its
    chunk hash is started: while every byte of a chunk so far was the base's, nothing
    is hashed; at its first changed byte the unchanged bytes before it (the base's,
    read back from the base file) are hashed, then the rest as it comes."""

    def __init__(
        self, name: str, base_path: str, base: FileEntry, inner: HashingWriter, on_close: Any
    ):
        super().__init__(name, on_close)  # the tree is hashed here, chunk by chunk
        self.chunk = tree.CHUNK
        self._base_path, self._inner = base_path, inner
        # The base's chunk hashes stand for unchanged chunks when they are of this size.
        self._base = base if base.tree is not None and base.tree.chunk == tree.CHUNK else None
        self._head = bytearray()  # the first bytes, held until the image is chosen
        self._off = 0  # bytes of the new file already XORed into frames
        self._fbuf = np.empty(FRAME, np.uint8)  # the frame being filled
        self._fill = 0  # bytes of the frame being filled
        # Frames being encoded, in file order: (the encode, the XOR it reads).
        self._encoding: deque[tuple[Future, np.ndarray]] = deque()
        # FRAME-byte buffers of written frames: fresh pages cost more than the XOR.
        self._spare: list[np.ndarray] = []
        self._image: BaseImage | None = None
        self._frames: FrameWriter | None = None
        self._chunks: list[Any] = []  # per chunk: its digest, or the hasher it is fed to
        # The current chunk's start while every byte of it so far is the base's.
        self._same_since: int | None = None
        self._hashing: list[Future] = []  # chunk hashes of the bytes handed to _emit
        self._live = True
        with _LIVE_LOCK:
            _LIVE[0] += 1

    def _emit(self, mv: memoryview) -> None:
        futs = self._hash_sha(mv)  # the file's sha256 overlaps XOR, chunk hashes and encoding
        try:
            if self._frames is not None:
                self._xor(mv)
            else:
                self._head += mv
                self._start_if_ready(final=False)
        finally:
            wait(futs + self._take_hashing())  # the caller may reuse its buffer after write()

    def _take_hashing(self) -> list[Future]:
        futs, self._hashing = self._hashing, []
        return futs

    def _start_if_ready(self, final: bool) -> None:
        """Pick the image once the head is known; the first frame holds the whole head."""
        head = self._head
        new, size = None, None
        if self.name.endswith(".safetensors"):
            size = header_size(bytes(head[:8]))
            if not final and (len(head) < 8 or size is not None and len(head) < size):
                return
            new = parse_layout(head) if size is not None else None
        base = read_layout(self._base_path) if new is not None else None
        if new is not None and base is not None:
            self._image, mode = BaseImage.tensors(self._base_path, base, new), TENSORS
        else:
            self._image, mode = BaseImage.raw(self._base_path), RAW
        self._frames = FrameWriter(self._inner, mode)
        self._head = bytearray()
        first = first_frame(size or 0)
        if first > len(self._fbuf):
            self._fbuf = np.empty(first, np.uint8)
        self._xor(memoryview(head))

    def _xor(self, mv: memoryview) -> None:
        """XOR ``mv`` (the next new bytes) into the frame buffer, piece by piece (no
        piece crosses a chunk); a full frame is sent."""
        assert self._image is not None and self._frames is not None
        i, step = 0, self.chunk
        while i < len(mv):
            n = min(len(self._fbuf) - self._fill, len(mv) - i, step - self._off % step)
            x = self._image.read_into(self._off, self._fbuf[self._fill : self._fill + n])
            xor_into(x, mv[i : i + n])
            self._hash_piece(mv[i : i + n], x)
            i, self._off, self._fill = i + n, self._off + n, self._fill + n
            if self._off % step == 0:
                self._end_chunk(self._off)
            if self._fill == len(self._fbuf):
                self._send()

    def _hash_piece(self, piece: memoryview, x: np.ndarray) -> None:
        """Start the chunk hash of ``piece`` (new bytes at ``self._off``; ``x``: their XOR)."""
        assert self._image is not None
        lo, hi = self._off, self._off + len(piece)
        if lo % self.chunk == 0:  # a new chunk: the base's, until a byte says otherwise
            self._chunks.append(None)
            self._same_since = lo if self._base is not None else None
        start = self._same_since
        if start is not None and self._image.identical(lo, hi) and is_zero(x):
            return  # the base's bytes: hashed only if the chunk changes later
        h = self._chunks[-1]
        if start is not None:  # its first change: hash the base's bytes before it first
            self._same_since, h = None, tree.new_hasher()
            self._chunks[-1] = h
        elif h is None:
            h = self._chunks[-1] = tree.new_hasher()
        self._hashing.append(tree.pool().submit(self._feed, h, start, lo, piece))

    def _feed(self, h: Any, start: int | None, lo: int, piece: memoryview | None) -> None:
        """Feed ``h`` the base's bytes [start, lo) (the same as the new ones there), then
        ``piece``. One task per hasher at a time: its bytes go in order."""
        if start is not None and lo > start:
            assert self._image is not None
            h.update(self._image.read_into(start, np.empty(lo - start, np.uint8)))
        if piece is not None:
            h.update(piece)

    def _end_chunk(self, hi: int) -> None:
        """The current chunk ends at ``hi``: one whose bytes are all the base's takes the
        base's hash when the base's chunk spans the same bytes, else its bytes (the
        base's) are hashed."""
        start, self._same_since = self._same_since, None
        if start is None:
            return
        assert self._base is not None and self._base.tree is not None
        k = start // self.chunk
        hashes = self._base.tree.hashes
        if k < len(hashes) and min(start + self.chunk, self._base.bytes) == hi:
            self._chunks[k] = bytes.fromhex(hashes[k])
        else:
            h = self._chunks[k] = tree.new_hasher()
            self._hashing.append(tree.pool().submit(self._feed, h, start, hi, None))

    def _send(self) -> None:
        """Start encoding the filled frame; write the frames encoded so far."""
        x = self._fbuf[: self._fill]
        self._encoding.append((tree.pool().submit(encode, x), x))
        self._fill = 0
        self._fbuf = self._spare.pop() if self._spare else np.empty(FRAME, np.uint8)
        self._write_frames(_ahead())

    def _write_frames(self, keep: int) -> None:
        """Write the encoded frames at the head of the queue, in file order, waiting
        for the oldest while more than ``keep`` are in flight."""
        assert self._frames is not None
        q = self._encoding
        while q and (len(q) > keep or q[0][0].done()):
            fut, x = q[0]
            self._frames.add(len(x), fut.result())
            q.popleft()
            if x.base is not None and len(x.base) == FRAME:  # not the first, larger frame
                self._spare.append(x.base)

    def _finish(self) -> None:
        try:
            if self._frames is None:
                self._start_if_ready(final=True)
            if self._off % self.chunk:
                self._end_chunk(self._off)
            if self._fill:
                self._send()
            self._write_frames(0)
        finally:
            wait(self._take_hashing())  # no hash may still read the image
        self.digests = [c if isinstance(c, bytes) else c.digest() for c in self._chunks]
        self._close_image()
        self._inner.close()

    def _close_image(self) -> None:
        if self._image is not None:
            self._image.close()
            self._image = None
        if self._live:
            self._live = False
            with _LIVE_LOCK:
                _LIVE[0] -= 1

    def abort(self) -> None:
        super().abort()
        for f in self._take_hashing():
            f.exception()  # no hash may still read the image
        encodes = [f for f, _ in self._encoding]
        self._encoding.clear()
        for f in encodes:
            f.cancel()
        wait_all(encodes)  # no encode of this file goes on running after it
        self._close_image()
        self._inner.abort()


def _own_name(name: str) -> str:
    """``name``, refused when it ends like a delta file (a reader would decode it)."""
    if name.endswith(DELTA_SUFFIX):
        raise StorageError(
            f"file name {name!r} ends with {DELTA_SUFFIX!r}, which delta versions reserve; "
            f"rename it"
        )
    return name


class DeltaWriter:
    """Publishes one version as a delta of ``base`` (see the module doc), through
    ``inner``, a ``WeightsWriter`` of the same version. ``base_dir``: a local folder
    holding the base's files."""

    def __init__(self, inner: WeightsWriter, base: WeightsManifest, base_dir: str):
        if base.delta is not None:
            raise StorageError(
                f"{version_name(base.version)} is itself a delta; a delta's base must be a "
                f"full version"
            )
        self._inner, self._base, self._dir = inner, base, base_dir
        self._base_files = {f.name: f for f in base.files}
        self._lock = threading.Lock()
        self._full: dict[str, FileEntry] = {}  # rebuilt files not stored whole
        self.version = inner.version

    @property
    def already_committed(self) -> bool:
        return self._inner.already_committed

    @property
    def base(self) -> int:
        return self._base.version

    def open(self, name: str) -> HashingWriter:
        """A file of the version: XORed against the base's file of this name, or
        stored whole when the base has none."""
        b = self._base_files.get(_own_name(name))
        if b is None:
            return self._inner.open(name)
        path = os.path.join(self._dir, name)
        verify_base_file(path, b, self._base.version, self.version)
        return _XorFile(name, path, b, self._inner.open(name + DELTA_SUFFIX), self._closed)

    def _closed(self, w: HashingWriter) -> None:
        with self._lock:
            self._full[w.name] = w.entry()

    def add_file(self, name: str, local_path: str) -> FileEntry:
        """Copy a local file (config, tokenizer) into the version; one equal to the
        base's file of that name is not stored (readers take the base's)."""
        n, sha = hash_file(local_path)
        b = self._base_files.get(_own_name(name))
        if b is not None and (b.bytes, b.sha256) == (n, sha):
            with self._lock:
                self._full[name] = b  # the base's entry, its tree included
            return b
        return self._inner.add_file(name, local_path)

    def commit(self) -> WeightsManifest:
        """Write the manifest (base, digest, full files) last; see WeightsWriter.commit."""
        with self._lock:
            full = dict(self._full)
        for name, e in self._inner.written().items():
            if not name.endswith(DELTA_SUFFIX):
                full[name] = e  # stored whole: the stored file is the full file
        delta = DeltaOf(
            base=self._base.version,
            base_digest=self._base.digest(),
            codec=CODEC,
            full=tuple(sorted(full.values(), key=lambda f: f.name)),
        )
        return self._inner.commit(delta)

    def abort(self) -> None:
        self._inner.abort()

    def __enter__(self) -> DeltaWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._inner.__exit__(exc_type, exc, tb)
