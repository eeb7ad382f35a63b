"""Colocated placement without a cluster: config checks that name the fix, the
shared group's bundles and who sits where, and device sleep/wake on CPU."""

from __future__ import annotations

import pytest
import torch

from actors.device_memory import DeviceMemory
from actors.placement import SharedPlacement, colocated_bundles
from flows.config import ConfigError, load_config

COLOCATE = {"placement.colocate": True}


def test_colocate_is_off_by_default_and_accepted_on_cpu():
    assert load_config(None).placement.colocate is False
    cfg = load_config(None, {**COLOCATE, "weights.transport": "tensor"})
    assert cfg.placement.colocate and cfg.weights.transport == "tensor"
    # CPU: gloo happily joins two ranks on one host, so every transport works.
    assert load_config(None, {**COLOCATE, "weights.transport": "distributed"})
    gpu = {**COLOCATE, "train.num_gpus_per_worker": 0.5, "engines.num_gpus_per_engine": 0.5}
    assert load_config(None, {**gpu, "weights.transport": "tensor"}).placement.colocate


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"train.num_gpus_per_worker": 0.5}, r"set both train.num_gpus_per_worker and engines"),
        ({"engines.num_gpus_per_engine": 1}, r"set both train.num_gpus_per_worker and engines"),
        (
            {"train.num_gpus_per_worker": 0.75, "engines.num_gpus_per_engine": 0.5},
            r"= 1.25 > 1.*lower them so they sum to at most 1",
        ),
        (
            {
                "train.num_gpus_per_worker": 0.5,
                "engines.num_gpus_per_engine": 0.5,
                "weights.transport": "distributed",
            },
            r"NCCL refuses two ranks on one GPU; use weights.transport: tensor",
        ),
        ({"engines.kind": "sglang"}, r"add it to engines.sglang.extra_args"),
        ({"engines.kind": "sglang", "engines.tp_size": 2}, r"needs engines.tp_size: 1"),
        ({"placement.colocated": True}, r"unknown key 'placement.colocated'"),
    ],
)
def test_impossible_colocations_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, {**COLOCATE, **overrides})


def test_fractions_that_fill_one_gpu_are_accepted():
    cfg = load_config(
        None, {**COLOCATE, "train.num_gpus_per_worker": 0.7, "engines.num_gpus_per_engine": 0.3}
    )
    assert cfg.train.num_gpus_per_worker == 0.7  # never rewritten


def test_one_bundle_per_device_with_the_cpus_of_its_ranks():
    # 3 train ranks, 2 engines x tp 2 = 4 engine ranks: 4 devices.
    bundles = colocated_bundles(3, 0.5, 4, 0.25, gpus=False)
    assert bundles == [{"CPU": 0.75}] * 3 + [{"CPU": 0.25}]
    gpu = colocated_bundles(2, 1.0, 1, 1.0, gpus=True)
    assert gpu == [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]


def test_train_rank_i_and_engine_rank_j_share_bundles():
    shared = SharedPlacement("r", tuple(colocated_bundles(4, 1, 4, 1, gpus=True)), tp_size=2)
    assert shared.name == "r/colocate-pg"
    assert [shared.train_bundle(r) for r in range(4)] == [0, 1, 2, 3]
    # Engine e's actor is its rank 0 on bundle e*tp; it places ranks 1.. on the rest.
    assert shared.engine_bundles(0) == [0, 1]
    assert shared.engine_bundles(1) == [2, 3]


def test_device_memory_on_cpu_changes_state_and_nothing_else():
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optim.step()
    ptrs = [p.data_ptr() for p in model.parameters()]
    mem = DeviceMemory(torch.device("cpu"), "train")
    assert mem.mode == "cpu"
    slept = mem.sleep([model, None], optim)
    assert slept | {"allocated_bytes": 0} == {
        "state": "asleep",
        "mode": "cpu",
        "changed": True,
        "transitions": 1,
        "allocated_bytes": 0,
        "device_used_bytes": 0,
    }
    assert mem.sleep([model], optim)["changed"] is False  # idempotent
    assert mem.wake([model], optim)["state"] == "awake"
    assert mem.wake([model], optim) | {"changed": None} == mem.report(changed=None)
    assert mem.transitions == 2
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # nothing moved


def test_device_memory_starts_awake_and_tells_whether_it_ever_slept():
    """What an actor makes with itself: awake, and a wake of an awake actor is no sleep
    (a push streams per bucket only for a rank that takes turns)."""
    model = torch.nn.Linear(2, 2)
    mem = DeviceMemory(torch.device("cpu"), "weights")
    assert mem.state == "awake" and not mem.has_slept
    assert mem.wake([model])["changed"] is False and not mem.has_slept
    mem.sleep([model])
    assert mem.has_slept and mem.wake([model])["state"] == "awake" and mem.has_slept
