"""Streaming writer for the safetensors format and HF sharding.

Owns the byte layout: 8-byte little-endian header length, a JSON header
(``dtype``, ``shape``, ``data_offsets`` per tensor, optional ``__metadata__``)
padded with spaces to a multiple of 8, then each tensor's raw bytes in order.
Writing it ourselves lets the trainer (which owns torch) stream tensor memory
straight into a hashing writer: no intermediate buffer, no second write. Must
not import torch or numpy; tensors arrive as buffers.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, BinaryIO

from storage import tree
from storage.errors import StorageError

# Bytes per element of each safetensors dtype code.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Shards written at once at most: each holds a sha256 stream and its write slices.
MAX_SHARD_WRITERS = 8


@dataclass(frozen=True)
class TensorEntry:
    """One tensor to write."""

    name: str  # state-dict key, e.g. "model.layers.0.mlp.up_proj.weight"
    dtype: str  # safetensors dtype code, e.g. "F32", "BF16", "F16", "I64"
    shape: tuple[int, ...]  # tensor shape; () for a scalar
    data: memoryview | bytes  # C-contiguous raw bytes, prod(shape) * itemsize long

    @property
    def nbytes(self) -> int:
        return _nbytes(self.data)


def _nbytes(data: memoryview | bytes) -> int:
    return memoryview(data).nbytes


def _check(e: TensorEntry) -> int:
    if e.dtype not in DTYPE_SIZES:
        raise StorageError(
            f"tensor {e.name!r}: unknown safetensors dtype {e.dtype!r}; use one of {sorted(DTYPE_SIZES)}"
        )
    want = math.prod(e.shape) * DTYPE_SIZES[e.dtype]
    got = _nbytes(e.data)
    if got != want:
        raise StorageError(
            f"tensor {e.name!r}: {got} bytes of data but shape {list(e.shape)} x {e.dtype} needs {want}; "
            "pass the tensor's contiguous bytes (e.g. t.contiguous().view(torch.uint8).numpy())"
        )
    if not memoryview(e.data).c_contiguous:
        raise StorageError(f"tensor {e.name!r}: data is not C-contiguous; call .contiguous() first")
    return want


def header_bytes(entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix plus the padded JSON header for ``entries`` in their order."""
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise StorageError(
                "safetensors metadata must map str to str; convert values with str()"
            )
        header["__metadata__"] = metadata
    off = 0
    for e in entries:
        if e.name in header:
            raise StorageError(f"tensor name {e.name!r} appears twice; names must be unique")
        n = _check(e)
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header so tensor data starts 8-aligned
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(
    f: BinaryIO, entries: list[TensorEntry], metadata: dict[str, str] | None = None
) -> None:
    """Stream one safetensors file into ``f`` (any writable binary file)."""
    f.write(header_bytes(entries, metadata))
    for e in entries:
        if _nbytes(e.data):
            f.write(e.data)


def plan_shards(entries_sizes: Sequence[int], shard_size: int) -> list[list[int]]:
    """Group entry indices, in order, into shards of at most ``shard_size`` bytes
    (a single entry larger than that gets a shard of its own), like HF does."""
    if shard_size <= 0:
        raise StorageError(f"shard_size must be > 0, got {shard_size}")
    shards: list[list[int]] = []
    cur: list[int] = []
    cur_bytes = 0
    for i, n in enumerate(entries_sizes):
        if cur and cur_bytes + n > shard_size:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += n
    if cur or not shards:
        shards.append(cur)
    return shards


def shard_names(n: int) -> list[str]:
    """HF names: ``model.safetensors`` for one shard, else ``model-00001-of-00003.safetensors``..."""
    if n == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def hf_index(
    entries: Sequence[TensorEntry], plan: list[list[int]], names: list[str]
) -> dict[str, Any]:
    """Contents of ``model.safetensors.index.json`` for a sharded save."""
    weight_map = {entries[i].name: names[s] for s, idx in enumerate(plan) for i in idx}
    total = sum(e.nbytes for e in entries)
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def write_hf_shards(
    open_file: Callable[[str], AbstractContextManager[BinaryIO]],
    entries: list[TensorEntry],
    shard_size: int = 5 << 30,
    metadata: dict[str, str] | None = None,
    workers: int | None = None,
) -> list[str]:
    """Write ``entries`` as HF shards through ``open_file(name)`` (e.g. ``WeightsWriter.open``),
    plus the index when there is more than one shard. Shards are written by up to
    ``workers`` threads (default: one per core, at least 2 so a write overlaps another
    file's hashing, at most ``MAX_SHARD_WRITERS``): a file's sha256 runs on one core,
    so shards written at once hash at once.
    Returns the file names written."""
    if workers is None:
        workers = max(2, min(MAX_SHARD_WRITERS, tree.workers()))
    if metadata is None:
        metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    plan = plan_shards([e.nbytes for e in entries], shard_size)
    names = shard_names(len(plan))

    def one(s: int) -> None:
        with open_file(names[s]) as f:
            write_safetensors(f, [entries[i] for i in plan[s]], metadata)

    if workers > 1 and len(plan) > 1:
        with ThreadPoolExecutor(
            min(workers, len(plan)), thread_name_prefix="storage-shard"
        ) as pool:
            for fut in [pool.submit(one, s) for s in range(len(plan))]:
                fut.result()
    else:
        for s in range(len(plan)):
            one(s)
    if len(plan) == 1:
        return names
    with open_file(INDEX_NAME) as f:
        f.write((json.dumps(hf_index(entries, plan, names), indent=2) + "\n").encode())
    return [*names, INDEX_NAME]
