"""The bytes of one delta file: a new file XORed against an image of its base file,
cut into frames, each encoded on its own.

Layout of ``<name>.xor.zst`` as written (codec ``xor-words``)::

    b"PRLXD2"  magic: the codec
    b"T" | b"R"  T: the image is the base's tensors placed at the new file's offsets
                 (safetensors, matched by name, dtype and size); R: the base file as is
    frames     [u32 n][u32 c][c bytes: one zstd frame], in file order, all integers
               little-endian; the frame covers the next n bytes of the new file, and its
               zstd frame holds, for their XOR x with the image viewed as n // 8 words
               of 8 bytes: a bitmap of the nonzero words (bit i of byte j: word 8j + i;
               the unused bits of the last byte zero), those k words as 8 byte planes
               (byte 0 of each, in word order, then byte 1, ..., byte 7: 8k bytes),
               then the n % 8 bytes of x past the last whole word

Deltas written before ``xor-words`` (codec ``xor-zstd``, magic ``b"PRLXD1"``, the same
mode byte) hold frames ``[u32 c][zstd frame of all of x]``; they are read, never
written. A reader is told the codec by the manifest and refuses a file whose magic
names another.

The image (``storage.delta_image``) is zero wherever the base has nothing to offer (a
safetensors header, a new tensor, bytes past the base's end), so those bytes are
stored as they are.
Matching tensors by name (not by offset) keeps a delta small even when the base
was laid out by another writer (v0 is the base model's own files). An RL step
changes few bf16 values, so most 8-byte words of the XOR are zero (at lr 1e-6, 3% of
the values change and an eighth of the words): zstd then sees the bitmap and those
words instead of every byte, and a reader XORs only those words into the image. At a
step that changes most values, the bitmap adds a sixty-fourth to the bytes zstd sees.
Byte planes put alike bytes together for any dtype (bf16, fp32): the XOR of a value's
top byte (sign, exponent) is mostly zero, of its lowest byte mostly not; zstd packs
them 9-23% smaller than whole words (synthetic steps), for no more CPU.

The first frame always holds the whole safetensors header (a reader learns the
new layout from it before it needs the image). Frames line up with the chunks of
the file's hash tree (``storage.tree``): the first one is a whole number of
``FRAME``s, every later one ``FRAME`` bytes, the last one shorter; so a writer
encodes frames on every core and a reader decodes them so, hashing each chunk as
it writes it. ``xor-zstd`` deltas written before hash trees have frames of any size
(their readers check the sha256). Owns the frames' encoding only: no manifests, no
hashing, no fsspec. Must not import torch.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO, Final

import numpy as np

from storage.errors import IntegrityError, StorageError
from storage.tree import CHUNK

# Codec name (the manifest's DeltaOf.codec) -> the magic its files start with.
MAGICS = {"xor-zstd": b"PRLXD1", "xor-words": b"PRLXD2"}
CODEC: Final = "xor-words"  # the codec FrameWriter writes
TENSORS, RAW = b"T", b"R"
DELTA_SUFFIX = ".xor.zst"
FRAME = CHUNK  # bytes of the new file per frame: one chunk of its hash tree
LEVEL = 1  # the nonzero words of a bf16 step's XOR: level 1 is as small as 3 and faster


def _zstd():
    try:
        import zstandard
    except ImportError:  # a dependency of the project; named for a hand-made environment
        raise StorageError(
            "delta versions need the zstandard package; pip install zstandard"
        ) from None
    return zstandard


def is_zero(x: np.ndarray) -> bool:
    """True when every byte of ``x`` (uint8) is zero. A max over 8-byte words: four
    times as fast as ``x.any()``, which first casts every byte to a bool."""
    n = len(x) // 8 * 8
    return not (n and x[:n].view(np.uint64).max()) and not x[n:].any()


def xor_into(image: np.ndarray, new: bytes | bytearray | memoryview) -> np.ndarray:
    """image ^= new, in place (uint8): the delta when encoding, the file when decoding."""
    return np.bitwise_xor(image, np.frombuffer(new, np.uint8), out=image)


class FrameWriter:
    """Writes the magic of ``CODEC``, the mode, then one frame per ``add`` into ``out``.
    Frames are encoded apart (``encode``, on any thread) and added in file order."""

    def __init__(self, out: BinaryIO, mode: bytes):
        self._out = out
        out.write(MAGICS[CODEC] + mode)

    def add(self, n: int, c: bytes) -> None:
        """One frame: ``c``, ``encode`` of the XOR of the next ``n`` bytes of the new file."""
        self._out.write(struct.pack("<II", n, len(c)))
        self._out.write(c)


_local = threading.local()  # a compressor per thread: python-zstandard's are not shared


def encode(x: np.ndarray) -> bytes:
    """``encode_words`` of ``x`` with this thread's compressor (level ``LEVEL``): the same
    bytes on every thread."""
    c = getattr(_local, "compressor", None)
    if c is None:
        c = _local.compressor = _zstd().ZstdCompressor(level=LEVEL)
    return encode_words(c, x)


def encode_words(compressor: Any, x: np.ndarray) -> bytes:
    """The zstd frame of an ``xor-words`` frame of the XOR ``x`` (see the module doc)."""
    n8 = len(x) // 8 * 8
    w = x[:n8].view(np.uint64)
    nz = w != 0
    # By index, not by mask: numpy's gather by a mask takes twice as long, even counting
    # flatnonzero.
    words = w[np.flatnonzero(nz)].view(np.uint8).reshape(-1, 8)
    bits = np.packbits(nz, bitorder="little")
    body = np.empty(len(bits) + words.size + len(x) - n8, np.uint8)
    body[: len(bits)] = bits
    body[len(bits) : len(bits) + words.size].reshape(8, -1)[:] = words.T
    body[len(bits) + words.size :] = x[n8:]
    return compressor.compress(body)


def first_frame(header: int) -> int:
    """Bytes of the first frame of a file whose safetensors header (8 + JSON) is
    ``header`` bytes: whole frames, the whole header in them."""
    return max(1, -(-header // FRAME)) * FRAME


def read_mode(f: BinaryIO, codec: str, where: str) -> bytes:
    """The image mode (TENSORS or RAW) of a delta file the manifest says is ``codec``,
    read from its head, once its magic agrees."""
    want = MAGICS[codec]
    head = f.read(len(want) + 1)
    magic, mode = head[: len(want)], head[len(want) :]
    if magic != want:
        other = [k for k, m in MAGICS.items() if m == magic]
        if other:
            raise IntegrityError(
                f"{where} is a {other[0]!r} delta file but its manifest says {codec!r}; "
                f"the manifest or the file is damaged"
            )
        raise IntegrityError(f"{where} is not a {codec!r} delta file (bad magic {magic!r})")
    if mode not in (TENSORS, RAW):
        raise IntegrityError(f"{where}: unknown image mode {mode!r}")
    return mode


def _read_exact(reader: Any, out: np.ndarray, where: str, what: str) -> None:
    """Fill ``out`` (uint8) from a zstd stream reader; IntegrityError if it ends first."""
    view, got = memoryview(out), 0
    while got < len(out) and (k := reader.readinto(view[got:])):
        got += k
    if got != len(out):
        raise IntegrityError(f"{where}: a frame ends inside {what} ({got} of {len(out)} bytes)")


class DenseXor:
    """The decoded XOR of a frame, all of it: which of its bytes are zero."""

    def __init__(self, x: np.ndarray):
        self._x = x

    def zero(self, lo: int, hi: int) -> bool:
        return is_zero(self._x[lo:hi])


class SparseXor:
    """The XOR of an ``xor-words`` frame as its nonzero-word mask and its tail bytes."""

    def __init__(self, nz: np.ndarray, tail: np.ndarray):
        self._nz, self._tail = nz, tail

    def zero(self, lo: int, hi: int) -> bool:
        """Whether bytes [lo, hi) of the frame are zero; a word partly inside counts, so
        a range is never called zero while any of its bytes is not."""
        n8 = len(self._nz) * 8
        if hi > n8 and self._tail.any():
            return False
        return not self._nz[lo // 8 : -(-min(hi, n8) // 8)].any()


class XorZstd:
    """Reader of ``xor-zstd`` frames: ``[u32 c][zstd frame of all of the XOR]``."""

    def frames(self, f: BinaryIO, where: str, limit: int) -> Iterator[tuple[bytes, int]]:
        """(zstd frame, the bytes of the file it covers) of each frame after ``read_mode``.
        Every malformed byte is an IntegrityError naming ``where``; ``limit`` bounds
        what one frame may claim."""
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

    def xor(self, c: bytes, out: np.ndarray, scratch: np.ndarray, where: str) -> None:
        """Decode frame ``c`` into all of ``out`` (uint8, the frame's size)."""
        z = _zstd()
        try:
            reader = z.ZstdDecompressor().stream_reader(c)
            _read_exact(reader, out, where, "its bytes")
            if reader.read(1):
                raise IntegrityError(f"{where}: a frame holds more than {len(out)} bytes")
        except z.ZstdError as e:
            raise IntegrityError(f"{where}: a frame does not decompress ({e})") from e

    def apply(self, c: bytes, image: np.ndarray, scratch: np.ndarray, where: str) -> DenseXor:
        """image ^= frame ``c``'s XOR (``image``: the frame's bytes of the image; its
        XOR is decoded into ``scratch`` first)."""
        x = scratch[: len(image)]
        self.xor(c, x, scratch, where)
        xor_into(image, x)
        return DenseXor(x)


class XorWords:
    """Reader of ``xor-words`` frames (see the module doc)."""

    def frames(self, f: BinaryIO, where: str, limit: int) -> Iterator[tuple[bytes, int]]:
        """(zstd frame, the bytes of the file it covers) of each frame after ``read_mode``;
        as ``XorZstd.frames``."""
        while True:
            head = f.read(8)
            if not head:
                return
            if len(head) != 8:
                raise IntegrityError(f"{where} ends inside a frame's head")
            n, size = struct.unpack("<II", head)
            if not 0 < n <= limit:
                raise IntegrityError(f"{where}: a frame claims {n} bytes (limit {limit})")
            c = f.read(size)
            if len(c) != size:
                raise IntegrityError(f"{where} ends inside a frame ({len(c)} of {size} bytes)")
            yield c, n

    def xor(self, c: bytes, out: np.ndarray, scratch: np.ndarray, where: str) -> None:
        """Decode frame ``c`` into all of ``out`` (uint8, the frame's size)."""
        out[:] = 0
        self.apply(c, out, scratch, where)

    def apply(self, c: bytes, image: np.ndarray, scratch: np.ndarray, where: str) -> SparseXor:
        """image ^= frame ``c``'s XOR (``image``: the frame's bytes of the image); only
        its nonzero words are touched. ``scratch`` (uint8, at least the frame's size)
        holds their byte planes meanwhile."""
        n = len(image)
        n8 = n // 8 * 8
        words, bits = n8 // 8, np.empty(-(-n8 // 64), np.uint8)
        z = _zstd()
        try:
            size = z.frame_content_size(c)
            reader = z.ZstdDecompressor().stream_reader(c, read_across_frames=True)
            _read_exact(reader, bits, where, "its bitmap")
            whole, rest = divmod(words, 8)
            if rest and bits[whole] >> rest:
                raise IntegrityError(f"{where}: a frame's bitmap marks words past its end")
            nz = np.unpackbits(bits, count=words, bitorder="little").view(np.bool_)
            at = np.flatnonzero(nz)  # a scatter by mask takes four times as long
            k = len(at)
            body = scratch[: 8 * k + n - n8]
            if size != len(bits) + len(body):
                raise IntegrityError(
                    f"{where}: a frame holds {size} bytes, but its bitmap and the {k} words it "
                    f"marks make {len(bits) + len(body)}"
                )
            _read_exact(reader, body, where, "its words")
            if reader.read(1):  # read_across_frames: bytes after the frame are refused too
                raise IntegrityError(f"{where}: a frame holds more than its bitmap marks")
        except z.ZstdError as e:
            raise IntegrityError(f"{where}: a frame does not decompress ({e})") from e
        w = image[:n8].view(np.uint64)
        picked, planes = w[at], body[: 8 * k].reshape(8, k)
        cols = picked.view(np.uint8).reshape(k, 8)
        for j in range(8):  # byte j of each word, a plane at a time: faster than a transpose
            cols[:, j] ^= planes[j]
        w[at] = picked
        tail = body[8 * k :].copy()
        xor_into(image[n8:], tail)
        return SparseXor(nz, tail)


# DeltaOf.codec -> its reader.
CODECS: dict[str, XorZstd | XorWords] = {"xor-zstd": XorZstd(), "xor-words": XorWords()}
