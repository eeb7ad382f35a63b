"""PPO's critic maths on hand-computed numbers: outcome token rewards, GAE,
masked whitening and the clipped value loss."""

import pytest
import torch
from pydantic import ValidationError

from training.advantages import gae_advantages, outcome_token_rewards, whiten
from training.config import TrainConfig
from training.losses import value_loss

# Row layout: prompt target at t=0, response tokens at t=1..3, padding at t=4.
MASK = torch.tensor([[0.0, 1, 1, 1, 0]])
VALUES = torch.tensor([[9.0, 0.5, 0.2, 0.4, 7.0]])  # 9 and 7 sit off the mask: ignored


def test_outcome_reward_sits_on_the_last_response_token():
    mask = torch.tensor([[0.0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]])
    out = outcome_token_rewards(torch.tensor([1.0, -2.0, 5.0]), mask)
    assert out.tolist() == [[0, 0, 0, 1, 0], [0, 0, -2, 0, 0], [0, 0, 0, 0, 0]]


def test_gae_by_hand():
    rewards = outcome_token_rewards(torch.tensor([1.0]), MASK)
    adv, ret = gae_advantages(rewards, VALUES, MASK, gamma=0.5, lam=0.5)
    # t=3: delta = 1 - 0.4 = 0.6 (V after the last token is 0)      A = 0.6
    # t=2: delta = 0.5 * 0.4 - 0.2 = 0.0;   A = 0 + 0.25 * 0.6      = 0.15
    # t=1: delta = 0.5 * 0.2 - 0.5 = -0.4;  A = -0.4 + 0.25 * 0.15  = -0.3625
    assert adv[0].tolist() == pytest.approx([0, -0.3625, 0.15, 0.6, 0])
    assert ret[0].tolist() == pytest.approx([0, 0.1375, 0.35, 1.0, 0])  # A + V


def test_gae_with_gamma_and_lambda_one_is_reward_minus_value():
    rewards = outcome_token_rewards(torch.tensor([1.0]), MASK)
    adv, ret = gae_advantages(rewards, VALUES, MASK, gamma=1.0, lam=1.0)
    assert adv[0].tolist() == pytest.approx([0, 0.5, 0.8, 0.6, 0])
    assert ret[0].tolist() == pytest.approx([0, 1, 1, 1, 0])


def test_whiten_over_masked_entries():
    x = torch.tensor([[100.0, 1, 2, 3, -50]])
    out = whiten(x, MASK)
    # mean 2, unbiased std 1 over [1, 2, 3]
    assert out[0].tolist() == pytest.approx([0, -1, 0, 1, 0], abs=1e-6)


def test_value_loss_clips_by_hand():
    values = torch.tensor([[1.0, 0.4]], requires_grad=True)
    old, returns, mask = torch.tensor([[0.5, 0.5]]), torch.tensor([[2.0, 0.0]]), torch.ones(1, 2)
    loss, m = value_loss(values, old, returns, mask, clip_eps=0.2)
    # token 0: unclipped (1 - 2)^2 = 1, clipped (0.7 - 2)^2 = 1.69 -> 0.5 * 1.69 = 0.845
    # token 1: (0.4 - 0)^2 = 0.16 both ways (inside the clip range) -> 0.08
    assert float(loss.detach()) == pytest.approx((0.845 + 0.08) / 2)
    assert m["vf_clip_frac"] == 0.5
    loss.backward()
    # the clipped branch is flat in V: no gradient on token 0; token 1: (0.4 - 0) / 2
    assert values.grad[0].tolist() == pytest.approx([0.0, 0.2])


def test_value_loss_without_clip_is_half_squared_error():
    loss, m = value_loss(
        torch.tensor([[1.0, 3.0]]),
        torch.zeros(1, 2),
        torch.tensor([[0.0, 1.0]]),
        torch.ones(1, 2),
        clip_eps=None,
        num_tokens=4,
    )
    assert float(loss) == pytest.approx(0.5 * (1 + 4) / 4)
    assert m["vf_clip_frac"] == 0.0


@pytest.mark.parametrize(
    ("fields", "fix"),
    [
        ({"critic": {"lr": 0.5}}, "only used by train.loss.advantage: gae"),
        ({"backend": "megatron", "loss": {"advantage": "gae"}}, "set backend: torch"),
    ],
)
def test_critic_settings_need_ppo_on_the_torch_backend(fields, fix):
    with pytest.raises(ValidationError, match=fix):
        TrainConfig(**fields)
    assert TrainConfig(loss={"advantage": "gae"}, critic={"gamma": 0.9}).critic.gamma == 0.9
