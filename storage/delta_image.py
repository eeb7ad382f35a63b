"""The image a delta file is XORed against: its base file's bytes placed at the new
file's offsets (``storage.delta_format``'s mode T), or the base file as is (mode R).

Owns reading a safetensors header's layout (which tensor's bytes lie where) and the
``BaseImage`` that serves the base's bytes at the new layout's offsets, zero wherever
the base has nothing to offer (a header, a new tensor, bytes past the base's end).
No manifests, no hashing, no fsspec. Must not import torch.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np

from storage.errors import IntegrityError

MAX_HEADER = 100 << 20  # the safetensors library's own limit on a header

# name -> (dtype, absolute start, absolute end) of each tensor's bytes in its file.
Layout = dict[str, tuple[str, int, int]]


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
                    f"base file ended early: wanted {hi - lo} bytes at {boff + lo - start}, "
                    f"got {got}"
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
