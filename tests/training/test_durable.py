"""``DurableState`` on its own: a rank's checkpoints and published versions need
only what it is handed (its place in the run, a store per fence and a
``RankState`` of callables), never a train actor. One rank, CPU, no Ray."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from storage.config import StorageConfig
from storage.run_store import RunStore
from training import checkpoint
from training.config import WeightsConfig
from training.durable import DurableState, RankState


def durable(root, model_dir) -> tuple[DurableState, torch.nn.Module, list[str]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    storage = StorageConfig(root=str(root))
    calls: list[str] = []

    def snapshot(copy, staging):
        calls.append(f"snapshot copy={copy}")
        return checkpoint.snapshot(model, optim, 0, copy=copy, staging=staging)

    def hf_state(staging):
        calls.append(f"hf_state staging={staging is not None}")
        return {n: t.detach().clone() for n, t in model.state_dict().items()}

    hooks = RankState(
        snapshot=snapshot,
        restore=lambda store, k: checkpoint.load(store, k, model, optim),
        meta=lambda: {"backend": "test"},
        hf_state=hf_state,
    )
    stores: dict = {}

    def store(fence):
        return stores.setdefault(fence, RunStore(storage, "d", fence=fence))

    weights = WeightsConfig(shard_size=64 * 1024)
    return DurableState(0, 1, 7, "d", weights, store, hooks), model, calls


def step(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)


def test_save_load_and_publish_through_the_hooks_alone(tmp_path, tiny_model):
    d, model, calls = durable(tmp_path, tiny_model)
    meta = d.save(1, {"cursor": 3})
    assert meta == {
        "iteration": 1,
        "weights_version": 1,
        "seed": 7,
        "cursor": 3,
        "world_size": 1,
        "backend": "test",
        "warnings": [],
    }
    saved = {n: t.clone() for n, t in model.state_dict().items()}
    step(model)
    assert d.save(1) == {k: v for k, v in meta.items() if k != "warnings"}  # never rewritten
    assert d.load(1) == 1
    assert all(torch.equal(saved[n], t) for n, t in model.state_dict().items())

    summary = d.publish(1, 1, 0, model, tiny_model)
    assert summary["version"] == 1 and summary["shards"] > 1 and summary["warnings"] == []
    assert d.publish(1, 1, 0, model, tiny_model)["reused"] is True
    assert calls == ["snapshot copy=False", "hf_state staging=False"]


def test_background_writes_copy_now_and_report_failures_later(tmp_path, tiny_model):
    d, model, calls = durable(tmp_path, tiny_model)
    assert d.save(2, background=True, fail_background=True)["background"] is True
    bg = d.publish(2, 2, 1, model, tiny_model, background=True)
    assert bg == {"version": 2, "iteration": 2, "background": True, "warnings": []}
    step(model)  # training goes on while they are written
    (lost,) = d.wait()
    assert lost.startswith("checkpoint 2 was not written")
    assert d.wait() == []
    store = RunStore(StorageConfig(root=str(tmp_path)), "d")
    assert 2 not in store.committed_checkpoints()
    d.publish(3, 3, 2, model, tiny_model)  # waits for the background publish first
    assert {2, 3} <= set(store.committed_versions())
    assert calls == ["snapshot copy=True", "hf_state staging=True", "hf_state staging=False"]
