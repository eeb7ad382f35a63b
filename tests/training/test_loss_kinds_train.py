"""GSPO, DAPO and a rollout correction through the real train actor on Ray: one step on the tiny model.

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


def _one_step(tiny_model, storage_cfg, run: str, loss: dict):
    """(metrics, probe logprobs before, after) of train(1) on synthetic rollouts."""
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
    return m, before, after


@pytest.mark.parametrize(
    "loss",
    [
        {"kind": "gspo", "advantage": "reinforce_pp_baseline"},
        {"kind": "dapo", "advantage": "rloo", "overlong_filter": True, "kl_coef": 0.05},
    ],
    ids=["gspo", "dapo"],
)
def test_one_step_with_loss_kind(ray_cluster, tiny_model, storage_cfg, loss):
    m, before, after = _one_step(tiny_model, storage_cfg, f"loss-{loss['kind']}", loss)
    for key in ("loss", "pg_loss", "grad_norm", "entropy"):
        assert math.isfinite(m[key]), key
    assert m["grad_norm"] > 0 and m["response_tokens"] > 0
    assert m["clip_frac"] == 0.0  # one step from the old weights: every ratio is 1
    assert not torch.equal(before, after)  # the weights moved


def test_one_step_whose_sequences_the_geometric_mask_all_rejects(
    ray_cluster, tiny_model, storage_cfg
):
    """The step's result carries the mismatch between the synthetic engine's logprobs
    (-3.0 on every token, far from the tiny model's) and the trainer's, and the
    correction reaches the loss: a band this tight rejects every sequence, so the
    step has no gradient and the weights stay as they were."""
    loss = {"rollout_correction": {"kind": "geo_mask", "low": 0.99, "high": 1.01}}
    m, before, after = _one_step(tiny_model, storage_cfg, "loss-geo-mask", loss)
    assert m["rollout_logprob_abs_diff"] > 0.01 and m["rollout_logprob_kl"] > 0
    assert m["rollout_correction_frac"] == 1.0
    assert m["pg_loss"] == 0.0 and m["grad_norm"] == 0.0
    assert torch.equal(before, after)
