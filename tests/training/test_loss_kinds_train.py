"""GSPO and DAPO through the real train actor on Ray: one step on the tiny model.

The pure functions are checked on hand-computed numbers elsewhere; this proves
the config reaches the actor's loss and advantage path and that a step learns.
"""

from __future__ import annotations

import math

import pytest
import ray
import torch
from train_helpers import write_rollouts

from training.config import ModelConfig, RunIdentity, TrainConfig, TrainerSections, WeightsConfig
from training.group import TrainGroup

PROBE = [[1, 5, 9, 12, 7, 20, 2], [1, 8, 8, 4, 29, 3, 11]]


@pytest.mark.parametrize(
    "loss",
    [
        {"kind": "gspo", "advantage": "reinforce_pp_baseline"},
        {"kind": "dapo", "advantage": "rloo", "overlong_filter": True, "kl_coef": 0.05},
    ],
    ids=["gspo", "dapo"],
)
def test_one_step_with_loss_kind(ray_cluster, tiny_model, storage_cfg, loss):
    run = f"loss-{loss['kind']}"
    write_rollouts(storage_cfg, run, range(1, 2))
    train = TrainConfig(micro_batch_size=6, lr=1e-2, loss=loss)
    sections = TrainerSections(
        train=train, model=ModelConfig(), storage=storage_cfg, weights=WeightsConfig()
    )
    identity = RunIdentity(name=run, seed=7, namespace="prefect-rl")
    group = TrainGroup(identity, sections, placement=None, fence=None)
    try:
        group.create(tiny_model)
        before = ray.get(group.actors()[0].score.remote(PROBE))
        m = group.train(1)
        after = ray.get(group.actors()[0].score.remote(PROBE))
    finally:
        group.shutdown()
    for key in ("loss", "pg_loss", "grad_norm", "entropy"):
        assert math.isfinite(m[key]), key
    assert m["grad_norm"] > 0 and m["response_tokens"] > 0
    assert m["clip_frac"] == 0.0  # one step from the old weights: every ratio is 1
    assert not torch.equal(before, after)  # the weights moved
