"""Advantage estimators, DAPO's overlong shaping and their wiring into the train
batch, on hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from rollout.types import RolloutBatch, Sample
from training.advantages import (
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from training.algorithm import filter_loss_mask, sample_advantages
from training.batch import build_train_batch
from training.loss_config import LossConfig
from training.shaping import overlong_keep, overlong_penalty

TWO_GROUPS = torch.tensor([1.0, 0, 0, 0, 1, 2, 3, 6])


def test_rloo_leave_one_out_baseline():
    adv = rloo_advantages(TWO_GROUPS, n=4)
    # group 0: 1 - mean(0, 0, 0) = 1; 0 - mean(1, 0, 0) = -1/3
    # group 1 (sum 12): r - (12 - r) / 3 -> 1 - 11/3, 2 - 10/3, 3 - 3, 6 - 2
    expected = [1, -1 / 3, -1 / 3, -1 / 3, -8 / 3, -4 / 3, 0, 4]
    assert adv.tolist() == pytest.approx(expected)
    # the closed form n / (n - 1) * (r - group mean)
    assert adv.tolist() == pytest.approx((dr_grpo_advantages(TWO_GROUPS, 4) * 4 / 3).tolist())
    with pytest.raises(ValueError, match="at least 2 samples"):
        rloo_advantages(torch.ones(3), n=1)


def test_dr_grpo_mean_centring_only():
    adv = dr_grpo_advantages(TWO_GROUPS, n=4)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, -2, -1, 0, 3])


def test_reinforce_pp_global_batch_normalisation():
    # mean 1, deviations -1, -1, 1, 1; unbiased var 4/3, std 2/sqrt(3): A = +-sqrt(3)/2
    adv = reinforce_pp_advantages(torch.tensor([0.0, 0, 2, 2]), n=2, eps=0.0)
    h = math.sqrt(3) / 2
    assert adv.tolist() == pytest.approx([-h, -h, h, h])
    assert reinforce_pp_advantages(torch.full((4,), 3.0), n=2).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="groups of n=3"):
        reinforce_pp_advantages(torch.zeros(4), n=3)


def test_reinforce_pp_baseline_group_mean_then_batch_std():
    # centred: [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], mean 0,
    # unbiased var (0.5625 + 3 * 0.0625) / 7 = 0.75 / 7
    rewards = torch.tensor([1.0, 0, 0, 0, 2, 2, 2, 2])
    adv = reinforce_pp_baseline_advantages(rewards, n=4, eps=0.0)
    std = math.sqrt(0.75 / 7)
    assert adv.tolist() == pytest.approx(
        [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std] + [0] * 4
    )


def test_reinforce_pp_baseline_keeps_groups_relative_scale():
    # GRPO divides each group by its own std, so a 10x smaller spread gives the
    # same advantages; the batch std keeps the 10:1 ratio.
    rewards = torch.tensor([1.0, 0, 0, 0, 0.1, 0, 0, 0])
    grpo = grpo_advantages(rewards, n=4)
    assert grpo[0].item() == pytest.approx(grpo[4].item(), rel=1e-4)
    adv = reinforce_pp_baseline_advantages(rewards, n=4)
    assert adv[0].item() == pytest.approx(10 * adv[4].item(), rel=1e-4)


@pytest.mark.parametrize(
    ("kind", "fn"),
    [
        ("grpo", grpo_advantages),
        ("dr_grpo", dr_grpo_advantages),
        ("rloo", rloo_advantages),
        ("reinforce_pp", reinforce_pp_advantages),
        ("reinforce_pp_baseline", reinforce_pp_baseline_advantages),
    ],
)
def test_sample_advantages_dispatches_on_the_config(kind, fn):
    out = sample_advantages(LossConfig(advantage=kind), TWO_GROUPS, 4)
    assert torch.equal(out, fn(TWO_GROUPS, 4))


# -- DAPO overlong shaping ----------------------------------------------------------


def test_overlong_penalty_boundaries():
    # L_max 10, L_cache 4: free up to 6 tokens, then -1/4 per token, -1 from 10 on
    lengths = torch.tensor([0, 5, 6, 7, 9, 10, 11, 30])
    pen = overlong_penalty(lengths, max_len=10, cache_len=4)
    assert pen.tolist() == pytest.approx([0, 0, 0, -0.25, -0.75, -1, -1, -1])
    assert overlong_penalty(torch.tensor([9, 10]), 10, 10).tolist() == pytest.approx([-0.9, -1])
    for bad in (0, 11):
        with pytest.raises(ValueError, match="overlong_buffer below"):
            overlong_penalty(lengths, max_len=10, cache_len=bad)


def test_overlong_penalty_is_added_before_the_estimator():
    cfg = LossConfig(advantage="dr_grpo", overlong_buffer=4, max_response_tokens=8)
    # rewards 1, 1; lengths 4 (free) and 8 (full budget, -1): shaped 1, 0 -> +-0.5
    adv = sample_advantages(cfg, torch.tensor([1.0, 1.0]), 2, torch.tensor([4, 8]))
    assert adv.tolist() == pytest.approx([0.5, -0.5])
    with pytest.raises(ValueError, match="response lengths"):
        sample_advantages(cfg, torch.tensor([1.0, 1.0]), 2)


def test_overlong_filter_masks_truncated_samples():
    assert overlong_keep(["stop", "length", "abort"]).tolist() == [1.0, 0.0, 1.0]
    mask = torch.ones(3, 2)
    assert filter_loss_mask(LossConfig(), mask, ["length"] * 3) is mask  # off: untouched
    out = filter_loss_mask(LossConfig(overlong_filter=True), mask, ["stop", "length", "stop"])
    assert out.tolist() == [[1, 1], [0, 0], [1, 1]]


def _batch() -> RolloutBatch:
    # one prompt, 2 samples: a stopped 2-token answer (reward 1) and a truncated
    # 4-token one (reward 0)
    samples = [
        Sample(0, 0, [1, 5], [6, 2], [-1.0, -1.0], 1.0, 0, "stop"),
        Sample(0, 1, [1, 5], [7, 8, 9, 10], [-1.0] * 4, 0.0, 0, "length"),
    ]
    return RolloutBatch(1, 2, samples)


def test_train_batch_uses_the_configured_estimator_and_filter():
    default = build_train_batch(_batch(), pad_id=0)
    assert default.advantages.tolist() == pytest.approx([0.7071, -0.7071], abs=1e-4)
    assert default.num_tokens == 6
    cfg = LossConfig(advantage="rloo", overlong_filter=True)
    tb = build_train_batch(_batch(), pad_id=0, loss_cfg=cfg)
    assert tb.advantages.tolist() == pytest.approx([1.0, -1.0])  # 1 - 0, 0 - 1
    assert tb.num_tokens == 2 and tb.loss_mask[1].sum().item() == 0
    assert tb.rewards.tolist() == [1.0, 0.0]  # reported rewards stay unshaped
