"""Rollout corrections (train.loss.rollout_correction) on hand-computed numbers:
each kind's weights, the mismatch metrics, the loss they scale, and the config
values refused at load."""

from __future__ import annotations

import math

import pytest
import torch

from flows.config import ConfigError, load_config
from rollout.types import RolloutBatch, Sample
from training.algorithm import policy_loss
from training.batch import UnusableRollout, build_train_batch
from training.correction import (
    correction_weights,
    geo_mask_weights,
    log_ratio,
    mismatch_metrics,
    seq_mis_weights,
    tis_weights,
    token_mis_weights,
)
from training.loss_config import LossConfig
from training.losses import grpo_loss, gspo_loss

# Probabilities of the sampled tokens. Row 0: ratios trainer/engine [3, 0.5, 1.25]
# (product 1.875, geometric mean 1.875 ** (1/3) = 1.2331). Row 1: [1, 0.5] and a
# padding token whose made-up ratio (0.9 / 1e-9) must never count.
TRAINER = torch.log(torch.tensor([[0.6, 0.25, 0.5], [0.5, 0.25, 0.9]]))
ENGINE = torch.log(torch.tensor([[0.2, 0.5, 0.4], [0.5, 0.5, 1e-9]]))
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def _lr() -> torch.Tensor:
    return log_ratio(TRAINER, ENGINE, MASK)


def _on_mask(t: torch.Tensor) -> list[float]:
    return [float(x) for x in t[MASK.bool()]]


def test_tis_truncates_at_the_cap():
    w, truncated = tis_weights(_lr(), cap=2.0)
    assert _on_mask(w) == pytest.approx([2.0, 0.5, 1.25, 1.0, 0.5])  # 3 -> 2
    assert _on_mask(truncated) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert float(w[1, 2]) == 1.0  # padding: log ratio 0, whatever the tensors hold there


def test_token_mis_keeps_the_ratio_inside_the_band_only():
    w, rejected = token_mis_weights(_lr(), low=0.6, high=2.0)
    assert _on_mask(w) == pytest.approx([0.0, 0.0, 1.25, 1.0, 0.0])
    assert _on_mask(rejected) == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_seq_mis_weighs_a_row_by_its_product_of_ratios():
    w, rejected = seq_mis_weights(_lr(), low=0.4, high=1.5)
    # row 0: 3 * 0.5 * 1.25 = 1.875 > 1.5, rejected; row 1: 1 * 0.5 = 0.5, kept
    assert _on_mask(w) == pytest.approx([0.0, 0.0, 0.0, 0.5, 0.5])
    assert _on_mask(rejected) == [1.0, 1.0, 1.0, 0.0, 0.0]
    w, _ = seq_mis_weights(_lr(), low=0.4, high=2.0)
    assert _on_mask(w) == pytest.approx([1.875] * 3 + [0.5] * 2)


def test_seq_mis_rejects_a_product_beyond_float_range_without_nan():
    lr = torch.full((1, 200), 1.0)  # product exp(200): inf in float32
    w, rejected = seq_mis_weights(lr, low=0.5, high=2.0)
    assert torch.equal(w, torch.zeros(1, 200)) and bool(rejected.all())


def test_geo_mask_keeps_rows_whose_geometric_mean_is_inside_the_band():
    w, rejected = geo_mask_weights(_lr(), MASK, low=0.8, high=1.25)
    # row 0: 1.875 ** (1/3) = 1.2331, kept; row 1: 0.5 ** (1/2) = 0.7071, masked
    assert _on_mask(w) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert _on_mask(rejected) == [0.0, 0.0, 0.0, 1.0, 1.0]
    w, _ = geo_mask_weights(_lr(), MASK, low=0.9, high=1.2)  # 1.2331 > 1.2 now
    assert _on_mask(w) == [0.0] * 5


@pytest.mark.parametrize(
    ("kind", "frac"),
    # band [0.7, 2]: token ratios 3, 0.5 | 0.5 out; row products 1.875 | 0.5 (out);
    # geometric means 1.2331 | 0.7071, both in
    [("none", 0.0), ("tis", 1 / 5), ("token_mis", 3 / 5), ("seq_mis", 2 / 5), ("geo_mask", 0.0)],
)
def test_fraction_of_response_tokens_truncated_or_rejected(kind, frac):
    w, m = correction_weights(kind, TRAINER, ENGINE, MASK, cap=2.0, low=0.7, high=2.0)
    assert (w is None) == (kind == "none")
    assert m["rollout_correction_frac"] == pytest.approx(frac)


def test_mismatch_metrics_are_token_means_of_abs_diff_and_k3():
    m = mismatch_metrics(TRAINER, ENGINE, MASK)
    ratios = [3.0, 0.5, 1.25, 1.0, 0.5]
    abs_diff = sum(abs(math.log(r)) for r in ratios) / 5
    k3 = sum(r - 1 - math.log(r) for r in ratios) / 5  # KL(engine || trainer), k3
    assert m["rollout_logprob_abs_diff"] == pytest.approx(abs_diff, rel=1e-5)
    assert m["rollout_logprob_kl"] == pytest.approx(k3, rel=1e-5)
    same = mismatch_metrics(ENGINE, ENGINE, MASK)
    assert same == {"rollout_logprob_abs_diff": 0.0, "rollout_logprob_kl": 0.0}


def test_weights_scale_each_token_and_carry_no_gradient():
    lp = torch.zeros(1, 2, requires_grad=True)
    weights = torch.tensor([[2.0, 0.5]], requires_grad=True)
    loss, m = grpo_loss(
        lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 2), 0.2, is_weights=weights
    )
    assert loss.item() == pytest.approx((-2.0 - 0.5) / 2)  # ratio 1, A = 1: -w per token
    assert m["pg_loss"] == pytest.approx(-1.25)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-1.0, -0.25])  # d(-w * ratio)/d lp / 2
    assert weights.grad is None


def test_gspo_takes_a_rows_sequence_weight():
    lp = torch.zeros(2, 2)
    adv, mask = torch.tensor([1.0, -1.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    plain, _ = gspo_loss(lp, lp, adv, mask, 3e-4, 4e-4)
    masked, _ = gspo_loss(
        lp, lp, adv, mask, 3e-4, 4e-4, is_weights=torch.tensor([[1.0] * 2, [0.0] * 2])
    )
    assert plain.item() == pytest.approx(0.0)  # (-1 + 1) / 2
    assert masked.item() == pytest.approx(-0.5)  # row 1 masked: -1 / 2


def test_policy_loss_applies_the_configured_correction():
    cfg = LossConfig(rollout_correction={"kind": "tis", "cap": 2.0})
    adv = torch.tensor([1.0, -1.0])
    loss, m = policy_loss(cfg, TRAINER, TRAINER, adv, MASK, rollout_logprobs=ENGINE)
    # ratio 1 everywhere; -A * w summed over masked tokens / 5:
    # row 0: -(2 + 0.5 + 1.25); row 1: +(1 + 0.5)
    assert loss.item() == pytest.approx((-3.75 + 1.5) / 5)
    assert m["rollout_correction_frac"] == pytest.approx(0.2)
    assert m["rollout_logprob_abs_diff"] > 0 and m["rollout_logprob_kl"] > 0


def test_no_correction_gives_the_same_loss_bits():
    """Off (the default), the engines' logprobs only feed the metrics."""
    lp = (TRAINER + 0.1).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    plain, m0 = policy_loss(LossConfig(), lp, TRAINER, adv, MASK)
    measured, m1 = policy_loss(LossConfig(), lp, TRAINER, adv, MASK, rollout_logprobs=ENGINE)
    assert torch.equal(plain, measured) and m1["rollout_correction_frac"] == 0.0
    assert {k: m1[k] for k in m0} == m0


@pytest.mark.parametrize(
    ("sets", "named"),
    [
        ({"kind": "tis", "cap": 0.5}, "rollout_correction.cap"),
        ({"kind": "tis", "cap": "inf"}, "rollout_correction.cap"),
        ({"kind": "geo_mask", "low": 1.0}, "rollout_correction.low"),
        ({"kind": "geo_mask", "low": 0.0}, "rollout_correction.low"),
        ({"kind": "token_mis", "high": 1.0}, "rollout_correction.high"),
        ({"kind": "seq_mis", "high": "nan"}, "rollout_correction.high"),
        ({"kind": "tis", "low": 0.9}, "rollout_correction.low only applies"),
        ({"kind": "geo_mask", "cap": 3.0}, "rollout_correction.cap only applies"),
        ({"high": 3.0}, "rollout_correction.high only applies"),
        ({"kind": "icepop"}, "rollout_correction.kind"),
    ],
)
def test_bad_values_are_refused_at_load_with_the_key_named(sets, named):
    overrides = {f"train.loss.rollout_correction.{k}": v for k, v in sets.items()}
    with pytest.raises(ConfigError, match=named):
        load_config(None, overrides)


def test_token_corrections_are_refused_with_gspo():
    with pytest.raises(ConfigError, match="kind gspo weighs whole sequences"):
        load_config(None, {"train.loss.kind": "gspo", "train.loss.rollout_correction.kind": "tis"})
    cfg = load_config(
        None, {"train.loss.kind": "gspo", "train.loss.rollout_correction.kind": "geo_mask"}
    )
    assert cfg.train.loss.rollout_correction.kind == "geo_mask"


def test_a_sample_without_engine_logprobs_is_unusable_with_a_correction():
    batch = RolloutBatch(
        3, 2, [Sample(0, j, [1, 5], [6, 7], [], 1.0 * j, 2, "stop") for j in range(2)]
    )
    build_train_batch(batch, 0, LossConfig())  # off: a missing logprob is never read
    with pytest.raises(UnusableRollout, match="sample 0 of rollout batch 3 has 0 engine logprobs"):
        build_train_batch(batch, 0, LossConfig(rollout_correction={"kind": "tis"}))
