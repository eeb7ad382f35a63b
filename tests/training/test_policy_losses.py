"""Policy losses (DAPO, Dr. GRPO, GSPO), their config and dispatch, on hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from training.algorithm import policy_loss
from training.config import TrainConfig
from training.loss_config import LossConfig
from training.losses import dapo_loss, dr_grpo_loss, grpo_loss, gspo_loss, k3_kl, sequence_ratio


def _case():
    # ratios exp(lp - old): sample 0 (A=+1) [1.5, 0.9]; sample 1 (A=-1) [0.5, 1.1 masked]
    old = torch.zeros(2, 2)
    lp = torch.log(torch.tensor([[1.5, 0.9], [0.5, 1.1]])).requires_grad_(True)
    return lp, old, torch.tensor([1.0, -1.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])


def _random_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 5, generator=g) * 3
    lp = (old + 0.4 * torch.randn(4, 5, generator=g)).requires_grad_(True)
    mask = (torch.rand(4, 5, generator=g) > 0.3).float()
    return lp, old, torch.randn(4, generator=g), mask


# -- DAPO ----------------------------------------------------------------------


def test_dapo_decoupled_clip_token_mean():
    lp, old, adv, mask = _case()
    loss, m = dapo_loss(lp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    # A=+1, ratio 1.5: max(-1.5, -1.28) = -1.28 (upper clip at 1 + 0.28)
    # A=+1, ratio 0.9: -0.9 (inside [0.8, 1.28])
    # A=-1, ratio 0.5: max(0.5, 0.8) = 0.8 (lower clip at 1 - 0.2)
    assert loss.item() == pytest.approx((-1.28 - 0.9 + 0.8) / 3)
    assert m["clip_frac"] == pytest.approx(2 / 3)
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([0.0, -0.3, 0.0, 0.0])


def test_dapo_with_equal_eps_is_grpo_bit_for_bit():
    lp, old, adv, mask = _random_case()
    lp2 = lp.detach().clone().requires_grad_(True)
    ref = old - 0.1
    ent = torch.rand(4, 5)
    reg = {"ref_logprobs": ref, "kl_coef": 0.05, "entropy": ent, "entropy_coef": 0.01}
    a, ma = grpo_loss(lp, old, adv, mask, 0.2, num_tokens=17, **reg)
    b, mb = dapo_loss(lp2, old, adv, mask, 0.2, 0.2, num_tokens=17, **reg)
    a.backward()
    b.backward()
    assert torch.equal(a, b) and ma == mb
    assert torch.equal(lp.grad, lp2.grad)


# -- Dr. GRPO --------------------------------------------------------------------


def test_dr_grpo_divides_by_a_constant_budget():
    lp, old, adv, mask = _case()
    loss, m = dr_grpo_loss(lp, old, adv, mask, clip_eps=0.2, max_tokens=4)
    # per-token terms as GRPO's: -1.2 (clipped), -0.9, 0.8 (clipped); sum -1.3 over
    # 2 sequences * 4 budget tokens, not over the 3 real tokens
    assert loss.item() == pytest.approx(-1.3 / 8)
    assert m["pg_loss"] == pytest.approx(-1.3 / 3)  # metrics stay token means
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([0.0, -0.9 / 8, 0.0, 0.0])
    # a caller that split the batch passes the global sequence count
    loss, _ = dr_grpo_loss(lp, old, adv, mask, 0.2, max_tokens=4, num_sequences=4)
    assert loss.item() == pytest.approx(-1.3 / 16)


def test_dr_grpo_weight_per_token_does_not_depend_on_length():
    # Two sequences with the same advantage, 1 and 3 tokens, ratio 1: every token
    # gets gradient -A / (B * L) = -1 / 8, whatever its sequence's length.
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]])
    loss, _ = dr_grpo_loss(lp, lp.detach(), torch.ones(2), mask, 0.2, max_tokens=4)
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-0.125, 0, 0, -0.125, -0.125, -0.125])


# -- GSPO ------------------------------------------------------------------------


def test_gspo_sequence_ratio_is_geometric_mean_of_token_ratios():
    lp, old, _, mask = _random_case(1)
    ratios = torch.exp(lp.detach() - old)
    for i in range(4):
        r = ratios[i][mask[i] > 0]
        geo = float(torch.prod(r)) ** (1 / len(r)) if len(r) else 1.0
        assert sequence_ratio(lp.detach(), old, mask)[i].item() == pytest.approx(geo, rel=1e-5)
    assert sequence_ratio(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2)).item() == 1.0


def test_gspo_sequence_clip_by_hand():
    lp, old, adv, mask = _case()
    loss, m = gspo_loss(lp, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.2)
    s0 = math.sqrt(1.5 * 0.9)  # 1.1619, inside [0.9, 1.2]: term -A * s0 = -1.1619
    # sequence 1 has one token, s1 = 0.5; A=-1: max(0.5, 0.9) = 0.9 (clipped at 1 - 0.1)
    assert loss.item() == pytest.approx((-s0 + 0.9) / 2)
    assert m["clip_frac"] == pytest.approx(1 / 3)  # token-weighted: 1 of 3 tokens
    assert m["pg_loss"] == pytest.approx((2 * -s0 + 0.9) / 3)
    loss.backward()
    # d(-s0)/d lp_t = -s0 / 2 per token of sequence 0 (the mean over its 2 tokens),
    # then / 2 sequences: both tokens get the same gradient, unlike token-level PPO
    g = -s0 / 4
    assert lp.grad.flatten().tolist() == pytest.approx([g, g, 0.0, 0.0])


def test_gspo_paper_eps_clips_a_whole_sequence():
    # One token far off policy moves the sequence ratio past 1 + 4e-4: the whole
    # sequence is clipped and no token of it gets a gradient.
    lp = torch.tensor([[0.0, 0.0, 0.01]], requires_grad=True)
    loss, m = gspo_loss(lp, torch.zeros(1, 3), torch.ones(1), torch.ones(1, 3), 3e-4, 4e-4)
    assert m["clip_frac"] == 1.0 and loss.item() == pytest.approx(-(1 + 4e-4))
    loss.backward()
    assert lp.grad.abs().sum().item() == 0.0


def test_gspo_empty_row_and_regularisers():
    lp, ref = torch.zeros(2, 2), torch.full((2, 2), math.log(2.0))
    kl_tok = 2 - math.log(2.0) - 1  # k3 with d = log 2
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])  # row 1 has no response tokens
    ent = torch.tensor([[1.0, 3.0], [5.0, 5.0]])
    loss, m = gspo_loss(
        lp,
        lp,
        torch.tensor([0.0, 7.0]),
        mask,
        3e-4,
        4e-4,
        ref_logprobs=ref,
        kl_coef=0.5,
        entropy=ent,
        entropy_coef=0.1,
    )
    # row 0: A=0, so only its token means 0.5 * kl - 0.1 * 2; row 1 adds nothing; / 2 rows
    assert loss.item() == pytest.approx((0.5 * kl_tok - 0.1 * 2.0) / 2)
    assert m["kl"] == pytest.approx(kl_tok) and m["entropy"] == pytest.approx(2.0)


# -- dispatch and gradient direction ----------------------------------------------

KINDS = {
    "grpo": {},
    "dapo": {"kind": "dapo"},
    "dr_grpo": {"kind": "dr_grpo", "advantage": "dr_grpo", "max_response_tokens": 8},
    "gspo": {"kind": "gspo"},
}


def test_default_config_dispatches_to_grpo_bit_for_bit():
    lp, old, adv, mask = _random_case(2)
    lp2 = lp.detach().clone().requires_grad_(True)
    ref, ent = old - 0.2, torch.rand(4, 5)
    cfg = LossConfig(kl_coef=0.05, entropy_coef=0.01)
    a, ma = grpo_loss(lp, old, adv, mask, 0.2, ref, 0.05, ent, 0.01, num_tokens=9.5)
    b, mb = policy_loss(cfg, lp2, old, adv, mask, ref_logprobs=ref, entropy=ent, num_tokens=9.5)
    a.backward()
    b.backward()
    assert torch.equal(a, b) and ma == mb and torch.equal(lp.grad, lp2.grad)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_sgd_step_moves_logprob_with_the_advantage(kind, sign):
    torch.manual_seed(0)
    logits = torch.randn(1, 3, 6, requires_grad=True)  # one sequence of 3 tokens, vocab 6
    tokens = torch.tensor([[1, 4, 2]])

    def logprobs() -> torch.Tensor:
        return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)

    before = logprobs().detach()
    loss, _ = policy_loss(
        LossConfig(**KINDS[kind]), logprobs(), before, torch.tensor([sign]), torch.ones(1, 3)
    )
    loss.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    moved = (logprobs().detach() - before) * sign
    assert bool((moved > 0).all()), (kind, moved)


# -- config ----------------------------------------------------------------------


def test_loss_config_kinds_parse_and_round_trip():
    for fields in KINDS.values():
        cfg = TrainConfig(loss=fields).loss
        assert LossConfig.model_validate(cfg.model_dump()) == cfg  # run.json reload
    cfg = LossConfig(kind="gspo", gspo_clip_eps_low=1e-3, gspo_clip_eps_high=2e-3)
    assert (cfg.gspo_clip_eps_low, cfg.gspo_clip_eps_high, cfg.advantage) == (1e-3, 2e-3, "grpo")


@pytest.mark.parametrize(
    ("fields", "fix"),
    [
        ({"kind": "dapo", "clip_eps_low": 0.3, "clip_eps_high": 0.2}, "set clip_eps_high >= "),
        ({"kind": "gspo", "gspo_clip_eps_high": 1e-4}, "set gspo_clip_eps_high >= "),
        ({"clip_eps_high": 0.3}, "set kind: dapo or remove clip_eps_high"),
        ({"kind": "dapo", "gspo_clip_eps_low": 1e-3}, "set kind: gspo or remove"),
        ({"kind": "dr_grpo", "advantage": "dr_grpo"}, "set train.loss.max_response_tokens"),
        ({"kind": "dr_grpo", "max_response_tokens": 8}, "set train.loss.advantage: dr_grpo"),
        ({"overlong_buffer": 4}, "set max_response_tokens"),
        ({"overlong_buffer": 9, "max_response_tokens": 8}, "set max_response_tokens"),
        ({"kind": "ppo"}, "kind"),
        ({"advantage": "nope"}, "advantage"),
        ({"kind": "gspo", "advantage": "gae"}, "use kind grpo, dapo or dr_grpo with gae"),
        ({"clip_eps_low": 1.0, "kind": "dapo"}, "clip_eps_low"),
    ],
)
def test_loss_config_refuses_nonsense_with_the_fix(fields, fix):
    with pytest.raises(ValidationError, match=fix):
        LossConfig(**fields)


def test_k3_kl_is_shared():
    assert k3_kl(torch.zeros(2), torch.zeros(2)).tolist() == [0, 0]
