"""The engine's cache of opened ``tensor`` buckets (``engines.embedded.weight_cache``) with
the trainer's resident staging buffer (``training.weight_staging``), on CPU
shared memory: later updates reuse the opened segment without its metadata,
an unknown key is a cache miss, tied weights travel once, and a bucket that does
not fit leaves the model untouched."""

from __future__ import annotations

import os

import pytest
import torch

from engines.embedded.weight_cache import CacheMiss, ReceiverCache
from training.weight_staging import Layout, Staging, has_room, sweep_dead_segments
from wire import receiver as wr
from wire.errors import WeightLoadError


class Tied(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Embedding(11, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight  # tied, as HF ties lm_head to the embeddings
        self.norm = torch.nn.Parameter(torch.randn(4, generator=g).to(torch.bfloat16))
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(11, 4, generator=g))


def _named(m: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.detach()) for n, t in m.state_dict().items()]


def _staging(m: torch.nn.Module) -> Staging:
    layout, items = Layout.record(_named(m))
    list(items)  # the layout fills in as a first push streams the tensors
    return Staging(layout, torch.device("cpu"), "rank0")


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_resident_updates_reuse_the_open_segment_and_copy_exact_bytes():
    src, dst = Tied(0), Tied(1)
    layout, items = Layout.record(_named(src))
    list(items)
    aliases = {
        s.name: layout.slots[s.alias_of].name for s in layout.slots if s.alias_of is not None
    }
    assert aliases == {"head.weight": "emb.weight"}  # tied: its bytes travel once
    staging = Staging(layout, torch.device("cpu"), "rank0")
    cache = ReceiverCache()  # the engine's
    try:
        staging.fill(_named(src))
        full = staging.handle(full=True)
        assert cache.apply(dst, wr.check_handle(full), torch.device("cpu"), 0, 1) == (
            3,
            11 * 4 * 4 + 4 * 2,
        )
        assert _same(src, dst)
        with torch.no_grad():  # the trainer takes a step; the engine gets only a key now
            src.emb.weight.mul_(2)
            src.norm.add_(1)
        staging.fill(_named(src))
        short = wr.check_handle(staging.handle(full=False))
        assert all(p["metadata"] is None for p in short["parts"])
        cache.apply(dst, short, torch.device("cpu"), 0, 1)
        assert _same(src, dst) and dst.head.weight is dst.emb.weight
        # The engine's weights now live in one flat per dtype: an update is one copy each.
        assert dst.emb.weight.untyped_storage().nbytes() == 11 * 4 * 4
        with torch.no_grad():  # a sleep that moved the weights away and back
            dst.emb.weight.data = dst.emb.weight.data.clone()
            src.emb.weight.add_(1)
        staging.fill(_named(src))
        cache.apply(dst, staging.handle(full=False), torch.device("cpu"), 0, 1)
        assert _same(src, dst)
        with pytest.raises(CacheMiss):  # another engine never opened this key
            ReceiverCache().apply(Tied(2), short, torch.device("cpu"), 0, 1)
    finally:
        staging.close()
    assert not os.path.exists(full["path"])


def test_a_bucket_that_does_not_fit_leaves_the_model_untouched():
    src, dst = Tied(0), torch.nn.Linear(4, 3)
    staging = _staging(src)
    try:
        staging.fill(_named(src))
        before = {n: t.clone() for n, t in dst.state_dict().items()}
        with pytest.raises(WeightLoadError, match="does not fit"):
            ReceiverCache().plan(dst, staging.handle(full=True), torch.device("cpu"), 0, 1)
        assert all(torch.equal(before[n], t) for n, t in dst.state_dict().items())
    finally:
        staging.close()


def test_a_bound_trainer_model_is_the_staging_buffer():
    """A single rank's weights become views of its staging buffer: nothing to fill,
    same values, the same Parameter objects (the optimizer's keys)."""
    src, dst = Tied(0), Tied(1)
    params = list(src.parameters())
    before = {n: t.clone() for n, t in src.state_dict().items()}
    staging = _staging(src)
    cache = ReceiverCache()  # the engine's
    try:
        assert staging.bind(src) and staging.bound(src)
        assert not staging.bound(Tied(0))  # a rebuilt model is not the one bound
        assert list(src.parameters()) == params
        assert all(torch.equal(before[n], t) for n, t in src.state_dict().items())
        with torch.no_grad():
            src.norm.mul_(3)  # a training step writes the buffer the engine reads
        staging.ready()
        cache.apply(dst, staging.handle(full=True), torch.device("cpu"), 0, 1)
        assert _same(src, dst)
        src.norm.data = src.norm.data.clone()  # moved away: no longer bound
        assert not staging.bound(src)
    finally:
        staging.close()


def test_fresh_tensors_at_a_reused_address_are_not_aliases():
    """Gathered (FSDP) or converted (megatron) tensors are freed after their bucket,
    and the next one may get the same address: only live tensors can be tied."""

    def gathered():
        for i in range(6):
            yield f"layer.{i}.weight", torch.full((256, 256), float(i))

    layout, items = Layout.record(gathered())
    addresses = []
    for _, t in items:  # the consumer drops each tensor before the next comes
        addresses.append(t.untyped_storage().data_ptr())
        del t
    assert len(set(addresses)) < len(addresses)  # the allocator did reuse an address
    assert all(s.alias_of is None for s in layout.slots)


def test_staging_refuses_a_model_that_changed_under_it():
    src = Tied(0)
    staging = _staging(src)
    try:
        with pytest.raises(RuntimeError, match="changed under the staging buffer"):
            staging.fill(_named(src)[:2])
    finally:
        staging.close()


def test_segments_of_dead_producers_are_swept(tmp_path, monkeypatch):
    import training.weight_staging as st

    monkeypatch.setattr(st, "shm_dir", lambda: str(tmp_path))
    dead = tmp_path / f"{wr.SHM_PREFIX}999999999-abc"  # no such pid
    alive = tmp_path / f"{wr.SHM_PREFIX}{os.getpid()}-abc"
    dead.write_bytes(b"x")
    alive.write_bytes(b"x")
    assert sweep_dead_segments() == 1
    assert not dead.exists() and alive.exists()


def test_a_staging_buffer_that_does_not_fit_is_not_made():
    """A trainer streams per bucket when /dev/shm (or the GPU) cannot hold the model:
    the layout counts tied weights once, and the check reads the real free space."""
    src = Tied(0)
    layout, items = Layout.record(_named(src))
    list(items)
    assert layout.nbytes() == 11 * 4 * 4 + 4 * 2
    assert has_room(layout.nbytes(), torch.device("cpu"))
    assert not has_room(1 << 60, torch.device("cpu"))  # an exabyte fits nowhere


def test_a_new_producer_replaces_what_the_engine_held_open():
    """A restarted trainer is a new producer: the engine drops the old buffer (and the
    flats its weights were bound into) instead of keeping both."""
    src, dst = Tied(0), Tied(1)
    cache = ReceiverCache()  # the engine's
    old, new = _staging(src), _staging(src)
    new.channel = "rank0-restarted"
    try:
        for staging in (old, new):
            staging.fill(_named(src))
            cache.apply(dst, staging.handle(full=True), torch.device("cpu"), 0, 1)
            assert _same(src, dst)
        assert cache.channels() == ["rank0-restarted"]
    finally:
        old.close()
        new.close()
