"""Checkpoint files and snapshots. The optimizer state round-trips through its files: torch's
AdamW state, megatron's per-rank list with integer keys, and a checkpoint
written before the state moved to safetensors (``optim.pt``)."""

from __future__ import annotations

import torch

from storage import RunStore, StorageConfig
from training import checkpoint, optim_file


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    for _ in range(2):
        model(torch.randn(3, 8)).square().sum().backward()
        optim.step()
    return model, optim


def _write(store: RunStore, k: int, files) -> None:
    writer = store.checkpoint_writer(k)
    checkpoint.write_files(writer, files)
    writer.commit({"iteration": k})


def _assert_same(a, b) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_megatron_style_state_round_trips_with_its_types(tmp_path) -> None:
    _, optim = _trained(0)
    state = {"tensor_parallel": 2, "ranks": [optim.state_dict(), optim.state_dict()]}
    store = RunStore(StorageConfig(root=str(tmp_path)), "r")
    _write(store, 1, optim_file.files(state))
    back = checkpoint.read_optim(store, 1)
    # integer parameter ids stay integers, betas stay a tuple, every tensor bit-equal
    _assert_same(back, state)


def test_big_state_is_cut_into_shards_of_similar_size(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(optim_file, "SHARD_MIN_BYTES", 1024)
    state = {"state": {f"w{i}": {"exp_avg": torch.full((256 + i,), float(i))} for i in range(9)}}
    names = [name for name, _ in optim_file.files(state)]
    assert names[0] == optim_file.TREE_FILE
    assert len(names) == 1 + optim_file.MAX_SHARDS
    store = RunStore(StorageConfig(root=str(tmp_path)), "r")
    _write(store, 1, optim_file.files(state))
    sizes = [(tmp_path / "r" / "checkpoints" / "iter_000001" / n).stat().st_size for n in names[1:]]
    assert max(sizes) < 1.5 * min(sizes), sizes
    _assert_same(checkpoint.read_optim(store, 1), state)


def test_checkpoint_restores_into_a_fresh_optimizer_and_old_optim_pt_still_loads(tmp_path) -> None:
    model, optim = _trained(0)
    store = RunStore(StorageConfig(root=str(tmp_path)), "r")
    checkpoint.save(store, 1, model, optim, 0, {"iteration": 1})
    assert "optim.pt" not in store.checkpoint_files(1)

    fresh_model, fresh_optim = _trained(1)  # other weights and moments
    checkpoint.load(store, 1, fresh_model, fresh_optim)
    for name, p in model.state_dict().items():
        assert torch.equal(p, fresh_model.state_dict()[name])
    _assert_same(fresh_optim.state_dict()["state"], optim.state_dict()["state"])

    # A checkpoint of an earlier version of the project: torch.save in optim.pt.
    snap = checkpoint.snapshot(model, optim, 0, copy=True)
    _write(
        store,
        2,
        [
            (checkpoint.MODEL_FILE, lambda f: checkpoint.write_model_file(f, snap["model"])),
            (checkpoint.LEGACY_OPTIM_FILE, lambda f: torch.save(snap["optim"], f)),
            (checkpoint.RNG_FILE, lambda f: torch.save(snap["rng"], f)),
        ],
    )
    old_model, old_optim = _trained(2)
    checkpoint.load(store, 2, old_model, old_optim)
    _assert_same(old_optim.state_dict()["state"], optim.state_dict()["state"])


def test_a_background_snapshot_is_a_copy_in_buffers_reused_by_the_next(tmp_path) -> None:
    from training.host_staging import HostStaging

    model, optim = _trained(0)
    staging = HostStaging()
    first = checkpoint.snapshot(model, optim, 0, copy=True, staging=staging)
    weights = {n: t.clone() for n, t in first["model"].items()}
    moments = {n: s["exp_avg"].clone() for n, s in first["optim"]["state"].items()}
    model(torch.randn(3, 8)).square().sum().backward()
    optim.step()  # the live state moves on; the snapshot must not
    for n, t in first["model"].items():
        assert torch.equal(t, weights[n])
        assert t.data_ptr() != model.state_dict()[n].data_ptr()
    for n, s in first["optim"]["state"].items():
        assert torch.equal(s["exp_avg"], moments[n])
    # Once the first is written, the next snapshot reuses its buffers with the new values.
    store = RunStore(StorageConfig(root=str(tmp_path)), "r")
    checkpoint.write(store, 1, first, {"iteration": 1})
    second = checkpoint.snapshot(model, optim, 0, copy=True, staging=staging)
    for n, t in second["model"].items():
        assert t.data_ptr() == first["model"][n].data_ptr()
        assert torch.equal(t, model.state_dict()[n])
    # and what was written is the first snapshot's state: a fresh optimizer restores it
    fresh_model, fresh_optim = _trained(1)
    checkpoint.load(store, 1, fresh_model, fresh_optim)
    for n, t in fresh_model.state_dict().items():
        assert torch.equal(t, weights[n])
