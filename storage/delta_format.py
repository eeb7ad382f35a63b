"""The bytes of one delta file: a new file XORed against an image of its base file,
cut into frames, each compressed with zstd.

Layout of ``<name>.xor.zst``::

    b"PRLXD1"  magic and format version
    b"T" | b"R"  T: the image is the base's tensors placed at the new file's offsets
                 (safetensors, matched by name, dtype and size); R: the base file as is
    frames     [u32 little-endian length][zstd frame], in file order; each frame
               decompresses to the XOR of the next slice of the new file and the image

The image is zero wherever the base has nothing to offer (a safetensors header, a
new tensor, bytes past the base's end), so those bytes are stored as they are.
Matching tensors by name (not by offset) keeps a delta small even when the base
was laid out by another writer (v0 is the base model's own files). An RL step
changes few bf16 values, so the XOR is mostly zero bytes and zstd shrinks it.

The first frame always holds the whole safetensors header (a reader learns the
new layout from it before it needs the image). Frames line up with the chunks of
the file's hash tree (``storage.tree``): the first one is a whole number of
``FRAME``s, every later one ``FRAME`` bytes, the last one shorter; so a reader
decodes frames on every core and hashes each chunk as it writes it. Deltas written
before hash trees have frames of any size (their readers check the sha256). Owns
this format only: no manifests, no hashing, no fsspec. Must not import torch.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np

from storage.errors import IntegrityError, StorageError
from storage.tree import CHUNK

MAGIC = b"PRLXD1"
TENSORS, RAW = b"T", b"R"
DELTA_SUFFIX = ".xor.zst"
FRAME = CHUNK  # bytes of the new file per frame: one chunk of its hash tree
MAX_HEADER = 100 << 20  # the safetensors library's own limit on a header
LEVEL = 1  # the XOR of a bf16 step: level 1 is as small as 3 (4.0% of 8 MB) and 10% faster

# name -> (dtype, absolute start, absolute end) of each tensor's bytes in its file.
Layout = dict[str, tuple[str, int, int]]


def _zstd():
    try:
        import zstandard
    except ImportError:  # a dependency of the project; named for a hand-made environment
        raise StorageError(
            "delta versions need the zstandard package; pip install zstandard"
        ) from None
    return zstandard


def header_size(head: bytes) -> int | None:
    """8 + the JSON header's length of a safetensors file starting with ``head``;
    None when ``head`` is too short to say or cannot be a safetensors file."""
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head[:8])
    return 8 + n if 2 <= n <= MAX_HEADER else None


def parse_layout(head: bytes | memoryview) -> Layout | None:
    """The tensors of a safetensors file whose first bytes are ``head`` (its whole
    header included); None when it is not a well-formed one."""
    size = header_size(bytes(head[:8]))
    if size is None or len(head) < size:
        return None
    try:
        header = json.loads(bytes(head[8:size]))
    except ValueError:
        return None
    if not isinstance(header, dict):
        return None
    out: Layout = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (int(x) for x in info["data_offsets"])
            dtype = str(info["dtype"])
        except (TypeError, KeyError, ValueError):
            return None
        if not 0 <= start <= end:
            return None
        out[name] = (dtype, size + start, size + end)
    return out


def read_layout(path: str) -> Layout | None:
    """``parse_layout`` of a local file (None for files that are not safetensors)."""
    with open(path, "rb") as f:
        size = header_size(f.read(8))
        if size is None:
            return None
        f.seek(0)
        return parse_layout(f.read(size))


class BaseImage:
    """The bytes a new file is XORed against, read from a local base file on demand.

    ``segments`` are (start, end, base offset) in the new file's coordinates, sorted
    and disjoint; everything outside them reads as zeros."""

    def __init__(self, path: str, segments: list[tuple[int, int, int]]):
        self._fd = os.open(path, os.O_RDONLY)
        self._segments = segments

    @classmethod
    def raw(cls, path: str) -> BaseImage:
        return cls(path, [(0, os.path.getsize(path), 0)])

    @classmethod
    def tensors(cls, path: str, base: Layout, new: Layout) -> BaseImage:
        segs = []
        for name, (dtype, start, end) in new.items():
            b = base.get(name)
            if b is not None and b[0] == dtype and b[2] - b[1] == end - start and end > start:
                segs.append((start, end, b[1]))
        segs.sort()
        return cls(path, segs)

    def read_into(self, off: int, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` (uint8) with the image's bytes from ``off``; returns it. Reusing
        one buffer matters: fresh pages cost more than the XOR (first-touch faults)."""
        n, pos = len(out), off  # pos: the first byte of out not yet filled
        for start, end, boff in self._segments:
            if end <= pos:
                continue
            if start >= off + n:
                break
            lo, hi = max(start, pos), min(end, off + n)
            out[pos - off : lo - off] = 0
            got = os.preadv(self._fd, [memoryview(out[lo - off : hi - off])], boff + (lo - start))
            if got != hi - lo:
                raise IntegrityError(
                    f"base file ended early: wanted {hi - lo} bytes at {boff + lo - start}, got {got}"
                )
            pos = hi
        out[pos - off :] = 0
        return out

    def identical(self, lo: int, hi: int) -> bool:
        """True when the image over [lo, hi) is the base file's own bytes at the same
        offsets (a zero XOR there means the new bytes are the base's)."""
        pos = lo
        for start, end, boff in self._segments:
            if pos >= hi:
                break
            if end <= pos:
                continue
            if start > pos or boff != start:
                return False
            pos = end
        return pos >= hi

    def close(self) -> None:
        os.close(self._fd)


def is_zero(x: np.ndarray) -> bool:
    """True when every byte of ``x`` (uint8) is zero. A max over 8-byte words: four
    times as fast as ``x.any()``, which first casts every byte to a bool."""
    n = len(x) // 8 * 8
    return not (n and x[:n].view(np.uint64).max()) and not x[n:].any()


def xor_into(image: np.ndarray, new: bytes | bytearray | memoryview) -> np.ndarray:
    """image ^= new, in place (uint8): the delta when encoding, the file when decoding."""
    return np.bitwise_xor(image, np.frombuffer(new, np.uint8), out=image)


class FrameWriter:
    """Writes the magic, the mode, then one frame per ``add`` into ``out``."""

    def __init__(self, out: BinaryIO, mode: bytes):
        self._out = out
        # zstd's own workers (one per CPU): its output is the same for any number of them
        # (checked: 1-8 threads give identical frames), so deltas stay reproducible.
        self._c = _zstd().ZstdCompressor(level=LEVEL, threads=-1)
        out.write(MAGIC + mode)

    def add(self, x: np.ndarray) -> None:
        c = self._c.compress(x)
        self._out.write(struct.pack("<I", len(c)))
        self._out.write(c)


def first_frame(header: int) -> int:
    """Bytes of the first frame of a file whose safetensors header (8 + JSON) is
    ``header`` bytes: whole frames, the whole header in them."""
    return max(1, -(-header // FRAME)) * FRAME


def read_mode(f: BinaryIO, where: str) -> bytes:
    """The image mode (TENSORS or RAW) of a delta file, read from its head."""
    head = f.read(len(MAGIC) + 1)
    if head[: len(MAGIC)] != MAGIC or head[len(MAGIC) :] not in (TENSORS, RAW):
        raise IntegrityError(f"{where} is not a delta file (bad magic {head[:7]!r})")
    return head[len(MAGIC) :]


def compressed_frames(f: BinaryIO, where: str, limit: int) -> Iterator[tuple[bytes, int]]:
    """(zstd frame, the bytes it decompresses to) of each frame after ``read_mode``.
    Every malformed byte is an IntegrityError naming ``where``; ``limit`` bounds what
    one frame may claim."""
    z = _zstd()
    while True:
        lb = f.read(4)
        if not lb:
            return
        if len(lb) != 4:
            raise IntegrityError(f"{where} ends inside a frame length")
        (n,) = struct.unpack("<I", lb)
        c = f.read(n)
        if len(c) != n:
            raise IntegrityError(f"{where} ends inside a frame ({len(c)} of {n} bytes)")
        try:
            size = z.frame_content_size(c)
        except z.ZstdError as e:
            raise IntegrityError(f"{where}: a frame does not decompress ({e})") from e
        if size < 0 or size > limit:
            raise IntegrityError(f"{where}: a frame claims {size} bytes (limit {limit})")
        yield c, size


def decompress_into(c: bytes, out: np.ndarray, where: str) -> None:
    """Decompress zstd frame ``c`` into all of ``out`` (uint8, its claimed size)."""
    z = _zstd()
    size, view = len(out), memoryview(out)
    try:
        got, reader = 0, z.ZstdDecompressor().stream_reader(c)
        while got < size and (k := reader.readinto(view[got:])):
            got += k
        if got != size or reader.read(1):
            raise IntegrityError(f"{where}: a frame holds {got} bytes, not {size}")
    except z.ZstdError as e:
        raise IntegrityError(f"{where}: a frame does not decompress ({e})") from e
