"""The wire format of the in-memory weight transports: SGLang's ``flattened_bucket``.

Owns how a bucket of named tensors becomes one flat tensor per dtype plus
per-tensor metadata (name, shape, dtype, start, end, numel; start/end count
elements of the flat tensor), how it is rebuilt, and how a state dict is cut
into buckets bounded by a byte budget. Pure torch: no Ray, no transport, no
model. The trainer produces these buckets; the engine consumes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives inside a flat bucket (SGLang's FlattenedTensorMetadata)."""

    name: str  # parameter FQN, as in the HF state dict
    shape: tuple[int, ...]  # original shape
    dtype: str  # torch dtype name, e.g. "float32"
    start: int  # first element in the flat tensor
    end: int  # one past the last element
    numel: int  # end - start


@dataclass
class FlatBucket:
    """Tensors of one dtype concatenated into ``flat`` [sum numel]."""

    flat: torch.Tensor  # 1-D, one dtype, contiguous
    metadata: list[TensorMeta]  # in the order the tensors were added


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in bucket metadata")
    return dtype


def flatten(named: Iterable[tuple[str, torch.Tensor]]) -> list[FlatBucket]:
    """One FlatBucket per dtype, dtypes in first-seen order."""
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        groups.setdefault(t.dtype, []).append((name, t))
    buckets = []
    for dtype, items in groups.items():
        metas, start = [], 0
        for name, t in items:
            n = t.numel()
            metas.append(TensorMeta(name, tuple(t.shape), dtype_name(dtype), start, start + n, n))
            start += n
        flat = torch.cat([t.detach().reshape(-1) for _, t in items]) if items else None
        buckets.append(FlatBucket(flat=flat, metadata=metas))
    return buckets


def unflatten(bucket: FlatBucket) -> list[tuple[str, torch.Tensor]]:
    """Views into ``bucket.flat`` with the original names and shapes (no copy)."""
    return [(m.name, bucket.flat[m.start : m.end].view(m.shape)) for m in bucket.metadata]


def iter_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into buckets of at most ``bucket_bytes`` (a tensor
    larger than the budget gets a bucket of its own)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def flat_from_meta(metadata: list[TensorMeta]) -> int:
    """Number of elements of the flat tensor the metadata describes."""
    return max((m.end for m in metadata), default=0)
