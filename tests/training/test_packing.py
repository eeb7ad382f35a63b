"""Sequence packing and token-budget micro-batches: the split, the packed layout,
and the loss and gradients of a packed step equal the padded ones on the tiny model."""

from __future__ import annotations

import pytest
import ray
import torch
from train_helpers import synthetic_batch, write_rollouts
from transformers import AutoModelForCausalLM

from training import backend_torch as bt
from training.algorithm import policy_loss
from training.batch import budget_ranges, build_train_batch, rank_micro_batches, split_to
from training.config import (
    LossConfig,
    ModelConfig,
    RunIdentity,
    TrainConfig,
    TrainerSections,
    WeightsConfig,
)
from training.group import TrainGroup


def test_budget_ranges_cut_by_padded_or_packed_tokens():
    lengths = [4, 6, 3, 5, 2]
    # padded: [4,6] costs 2*6=12 <= 12, adding 3 costs 3*6=18; [3,5] 10, +2 -> 15 > 12
    assert budget_ranges(lengths, 64, 12, packed=False) == [(0, 2), (2, 4), (4, 5)]
    # packed: 4+6=10, +3=13 > 12; 3+5+2=10
    assert budget_ranges(lengths, 64, 12, packed=True) == [(0, 2), (2, 5)]
    # the row cap still holds, and a row over the budget runs alone instead of failing
    assert budget_ranges(lengths, 2, 100, packed=True) == [(0, 2), (2, 4), (4, 5)]
    assert budget_ranges([3, 20, 3], 64, 8, packed=True) == [(0, 1), (1, 2), (2, 3)]


def test_split_to_halves_the_largest_range():
    assert split_to([(0, 4), (4, 6)], 3) == [(0, 2), (2, 4), (4, 6)]
    assert split_to([(0, 1), (1, 4)], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="cannot split"):
        split_to([(0, 1)], 2)


def test_every_rank_runs_the_same_number_of_micro_batches():
    batch = synthetic_batch(3, prompts=4, n=4)
    full = build_train_batch(batch, pad_id=0)
    cfg = TrainConfig(num_workers=2, max_tokens_per_micro_batch=24, pack_sequences=True)
    per_rank = [rank_micro_batches(full, r, 2, cfg) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) > 1
    rows = torch.cat([mb.input_ids[:, :1] for mbs in per_rank for mb in mbs])
    assert rows.shape[0] == full.size  # every sample once, in order
    for mbs in per_rank:
        for mb in mbs:
            assert mb.size == 1 or int(mb.attention_mask.sum()) <= 24


def test_without_a_budget_the_split_is_the_row_count():
    full = build_train_batch(synthetic_batch(1), pad_id=0)
    mbs = rank_micro_batches(full, 1, 2, TrainConfig(micro_batch_size=3))
    assert [mb.size for mb in mbs] == [3, 3, 2]


def test_pack_rows_restarts_positions_and_drops_cross_sample_targets():
    ids = torch.tensor([[1, 5, 6], [1, 7, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    flat, pos, keep = bt.pack_rows(ids, mask)
    assert flat.tolist() == [[1, 5, 6, 1, 7]]
    assert pos.tolist() == [[0, 1, 2, 0, 1]]
    # next-token pairs (1,5) (5,6) (6,1) (1,7): the third crosses samples
    assert keep.tolist() == [True, True, False, True]


def test_packing_is_refused_for_megatron_and_without_a_token_budget():
    with pytest.raises(ValueError, match="pack_sequences needs backend: torch"):
        TrainConfig(backend="megatron", pack_sequences=True, max_tokens_per_micro_batch=64)
    with pytest.raises(ValueError, match="set train.max_tokens_per_micro_batch"):
        TrainConfig(pack_sequences=True)


def _step(model, full, cfg: TrainConfig, loss_cfg: LossConfig) -> tuple[float, list]:
    """The actor's accumulation on one rank: summed micro-batch losses and the grads."""
    model.zero_grad(set_to_none=True)
    mbs = rank_micro_batches(full, 0, 1, cfg)
    total = 0.0
    for mb in mbs:
        with torch.no_grad():
            old = bt.token_logprobs(
                model, mb.input_ids, mb.attention_mask, packed=cfg.pack_sequences
            )[0]
        lp, ent = bt.token_logprobs(
            model,
            mb.input_ids,
            mb.attention_mask,
            with_entropy=True,
            entropy_grad=True,
            packed=cfg.pack_sequences,
        )
        # A ratio away from 1 so the clip branch and the ratio's gradient both matter.
        loss, _ = policy_loss(
            loss_cfg,
            lp,
            old - 0.3 * mb.loss_mask,
            mb.advantages,
            mb.loss_mask,
            entropy=ent,
            num_tokens=full.num_tokens,
            num_sequences=full.size,
        )
        loss.backward()
        total += float(loss.detach())
    return total, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "loss_cfg",
    [
        LossConfig(kind="grpo", entropy_coef=0.01),
        LossConfig(kind="gspo", advantage="rloo", gspo_clip_eps_high=0.5),
    ],
    ids=["grpo-token", "gspo-sequence"],
)
def test_packed_loss_and_grads_equal_padded(tiny_model, loss_cfg):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa")
    full = build_train_batch(synthetic_batch(2, prompts=4, n=4), pad_id=0, loss_cfg=loss_cfg)
    padded = TrainConfig(micro_batch_size=full.size, loss=loss_cfg)
    packed = TrainConfig(max_tokens_per_micro_batch=40, pack_sequences=True, loss=loss_cfg)
    assert len(rank_micro_batches(full, 0, 1, packed)) > 2  # really several packed rows
    loss_a, grads_a = _step(model, full, padded, loss_cfg)
    loss_b, grads_b = _step(model, full, packed, loss_cfg)
    assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-6)
    assert any(g.abs().sum() > 0 for g in grads_a)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


PROBE = [[1, 5, 9, 12, 7, 20, 2], [1, 8, 8, 4, 29, 3, 11]]


def _train_once(storage_cfg, tiny_model, run: str, train: TrainConfig) -> tuple[dict, torch.Tensor]:
    write_rollouts(storage_cfg, run, range(1, 2))
    sections = TrainerSections(
        train=train, model=ModelConfig(), storage=storage_cfg, weights=WeightsConfig()
    )
    identity = RunIdentity(name=run, seed=7, namespace="prefect-rl")
    group = TrainGroup(identity, sections, placement=None, fence=None)
    try:
        group.create(tiny_model)
        metrics = group.train(1)
        # score is collective under FSDP: every rank joins, rank 0's answer is kept.
        return metrics, ray.get([a.score.remote(PROBE) for a in group.actors()])[0]
    finally:
        group.shutdown()


def test_packed_two_rank_step_matches_padded_one_rank(ray_cluster, tiny_model, storage_cfg):
    """Through the real actors: two FSDP ranks with packed, token-budget
    micro-batches (4 and 3 per rank before balancing, at budget 28) take the same step
    as one rank of padded micro-batches."""
    loss = LossConfig(kl_coef=0.05, entropy_coef=0.01)
    padded = TrainConfig(micro_batch_size=6, lr=1e-2, loss=loss)
    packed = TrainConfig(
        num_workers=2, lr=1e-2, loss=loss, max_tokens_per_micro_batch=28, pack_sequences=True
    )
    m_a, probe_a = _train_once(storage_cfg, tiny_model, "pack-off", padded)
    m_b, probe_b = _train_once(storage_cfg, tiny_model, "pack-on", packed)
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm"):
        assert m_b[key] == pytest.approx(m_a[key], rel=1e-4, abs=1e-6), key
    assert m_b["response_tokens"] == m_a["response_tokens"]
    torch.testing.assert_close(probe_b, probe_a, rtol=1e-4, atol=1e-5)


def test_packed_values_equal_padded(tiny_model):
    """The critic's value model packs the same way (HF skips the packed mask when
    a KV cache is on, so this guards use_cache=False)."""
    model = bt.build_value_model(tiny_model, "float32", torch.device("cpu"), 1, seed=3)
    full = build_train_batch(synthetic_batch(2), pad_id=0)
    padded = bt.token_values(model, full.input_ids, full.attention_mask)
    packed = bt.token_values(model, full.input_ids, full.attention_mask, packed=True)
    targets = full.attention_mask[:, 1:].bool()
    torch.testing.assert_close(packed[targets], padded[targets], rtol=1e-4, atol=1e-6)
    assert packed[~targets].abs().sum() == 0
