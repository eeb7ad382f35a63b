"""GRPO advantages and loss on hand-computed numbers."""

import math

import pytest
import torch

from training.advantages import grpo_advantages
from training.losses import grpo_loss, k3_kl


def test_advantages_group_normalised_with_unbiased_std():
    # mean 0.25, unbiased std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    adv = grpo_advantages(torch.tensor([1.0, 0, 0, 0, 2, 2, 2, 2]), n=4, eps=0.0)
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0])


def test_advantages_mean_only_and_bad_group_size():
    adv = grpo_advantages(torch.tensor([1.0, 0, 0, 0]), n=4, normalize_std=False)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    with pytest.raises(ValueError, match="groups of n=3"):
        grpo_advantages(torch.zeros(4), n=3)


def _case():
    # ratios exp(lp - old): sample 0 (A=+1) [1.5, 0.9]; sample 1 (A=-1) [0.5, 1.1 masked]
    old = torch.zeros(2, 2)
    lp = torch.log(torch.tensor([[1.5, 0.9], [0.5, 1.1]])).requires_grad_(True)
    return lp, old, torch.tensor([1.0, -1.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])


def test_ppo_clip_token_mean():
    lp, old, adv, mask = _case()
    loss, m = grpo_loss(lp, old, adv, mask, clip_eps=0.2)
    # per token: max(-1.5, -1.2) = -1.2 (clipped), -0.9, max(0.5, 0.8) = 0.8 (clipped)
    assert loss.item() == pytest.approx((-1.2 - 0.9 + 0.8) / 3)
    assert m["clip_frac"] == pytest.approx(2 / 3)
    assert "kl" not in m and "entropy" not in m
    loss.backward()
    # only the unclipped masked token has a gradient: d(-A * ratio)/d lp / 3 = -0.9 / 3
    assert lp.grad.flatten().tolist() == pytest.approx([0.0, -0.3, 0.0, 0.0])


def test_global_token_denominator():
    lp, old, adv, mask = _case()
    loss, _ = grpo_loss(lp, old, adv, mask, clip_eps=0.2, num_tokens=6)
    assert loss.item() == pytest.approx(-1.3 / 6)


def test_k3_kl_and_entropy_terms():
    assert k3_kl(torch.zeros(3), torch.zeros(3)).tolist() == [0, 0, 0]
    lp, ref = torch.zeros(1, 2), torch.full((1, 2), math.log(2.0))
    kl_tok = 2 - math.log(2.0) - 1  # exp(d) - d - 1 with d = log 2
    ent = torch.tensor([[1.0, 3.0]])
    loss, m = grpo_loss(
        lp,
        lp,
        torch.tensor([0.0]),
        torch.ones(1, 2),
        0.2,
        ref_logprobs=ref,
        kl_coef=0.5,
        entropy=ent,
        entropy_coef=0.1,
    )
    assert m["kl"] == pytest.approx(kl_tok)
    assert m["entropy"] == pytest.approx(2.0)
    assert loss.item() == pytest.approx(0.5 * kl_tok - 0.1 * 2.0)  # pg term is 0 (A = 0)
