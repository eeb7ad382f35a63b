"""The flattened_bucket wire format: buckets bounded by bytes, per-dtype flats,
metadata, an exact round trip (also through a shared-memory segment), and the
per-tensor checksums an adapter travels with."""

from __future__ import annotations

import hashlib

import pytest
import torch

from training.weight_sender import ShmSegment
from wire import receiver as wr
from wire.errors import WeightLoadError
from wire.flat_bucket import flatten, iter_buckets, unflatten
from wire.lora import check_checksums, checksums


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=g)),
        ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c.weight", torch.randn(2, 2, 2, generator=g)),
        ("d.steps", torch.arange(4, dtype=torch.int64)),
        ("e.mask", torch.tensor([True, False, True])),
        ("f.empty", torch.zeros(0, 4)),
    ]


def test_buckets_respect_the_byte_budget_and_keep_order():
    named = _named()
    buckets = list(iter_buckets(named, bucket_bytes=64))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    for b in buckets:
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= 64 or len(b) == 1  # a tensor over budget goes alone
    assert len(list(iter_buckets(named, bucket_bytes=1 << 20))) == 1


def test_flatten_groups_by_dtype_with_metadata():
    flats = flatten(_named())
    assert [b.flat.dtype for b in flats] == [torch.float32, torch.bfloat16, torch.int64, torch.bool]
    f32 = flats[0]
    assert [(m.name, m.shape, m.start, m.end, m.numel) for m in f32.metadata] == [
        ("a.weight", (3, 5), 0, 15, 15),
        ("c.weight", (2, 2, 2), 15, 23, 8),
        ("f.empty", (0, 4), 23, 23, 0),
    ]
    assert f32.metadata[0].dtype == "float32" and f32.flat.numel() == 23


def test_round_trip_is_exact_directly_and_through_shared_memory():
    named = dict(_named())
    flats = flatten(named.items())
    back = dict(item for b in flats for item in unflatten(b))
    seg = ShmSegment(flats)
    try:
        shm = dict(wr.named_tensors(wr.open_bucket(seg.handle, torch.device("cpu"))))
    finally:
        seg.close()
    for got in (back, shm):
        assert list(got) == [n for b in flats for n in (m.name for m in b.metadata)]
        for name, t in named.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape
            assert torch.equal(
                got[name].view(torch.uint8) if t.numel() else got[name],
                t.view(torch.uint8) if t.numel() else t,
            )


def test_distributed_metadata_matches_the_sender_layout():
    flats = flatten(_named())
    metas = [m for b in flats for m in b.metadata]
    rebuilt = wr.metadata_of(
        [m.name for m in metas], [m.dtype for m in metas], [list(m.shape) for m in metas]
    )
    assert rebuilt == [b.metadata for b in flats]


def test_in_memory_transports_validate_like_disk():
    import pytest

    from flows.config import ConfigError, load_config

    for transport in ("tensor", "distributed"):
        cfg = load_config(None, {"weights.transport": transport, "weights.bucket_bytes": 4096})
        assert cfg.weights.transport == transport and cfg.weights.bucket_bytes == 4096
        with pytest.raises(ConfigError, match=f"'{transport}' needs a local storage.root"):
            load_config(None, {"weights.transport": transport, "storage.root": "s3://b/p"})
    assert load_config(None, {}).weights.bucket_bytes == 512 * 1024 * 1024


def test_adapter_checksums_are_each_tensors_own_sha256_and_catch_a_change():
    # SGLang checks expected_checksums per tensor against the bytes it received: the
    # sender's figures must be each tensor's own bytes in order, whatever its dtype,
    # layout or place in a flat copy.
    named = dict(_named())
    named["g.transposed"] = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t()
    got = checksums(named)
    assert list(got) == list(named)
    for name, t in named.items():
        own = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert got[name] == hashlib.sha256(own).hexdigest(), name
    check_checksums(named, got)
    changed = {**named, "b.bias": named["b.bias"].clone()}
    changed["b.bias"][3] += 1
    with pytest.raises(WeightLoadError, match=r"'b\.bias'.*differ from their expected sha256"):
        check_checksums(changed, got)
