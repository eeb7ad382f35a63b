"""Train-batch layout: padding, next-token loss mask, rank and micro-batch splits."""

import pytest
import torch

from rollout.types import RolloutBatch, Sample
from training.batch import build_train_batch, micro_batches, rank_slice


def _sample(i, prompt, response, reward):
    return Sample(i // 2, i % 2, prompt, response, [-0.5] * len(response), reward, 0, "stop")


def test_layout_and_masks():
    batch = RolloutBatch(
        1, 2, [_sample(0, [1, 5], [6, 7, 2], 1.0), _sample(1, [1, 5, 8], [9], 0.0)]
    )
    tb = build_train_batch(batch, pad_id=0)
    assert tb.input_ids.tolist() == [[1, 5, 6, 7, 2], [1, 5, 8, 9, 0]]
    assert tb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # targets are input_ids[:, 1:]: row 0 -> [5, 6, 7, 2], row 1 -> [5, 8, 9, pad]
    assert tb.loss_mask.tolist() == [[0, 1, 1, 1], [0, 0, 1, 0]]
    assert tb.rollout_logprobs.tolist() == [[0, -0.5, -0.5, -0.5], [0, 0, -0.5, 0]]
    assert tb.num_tokens == 4
    # one group of two: rewards [1, 0] -> mean 0.5, unbiased std sqrt(0.5)
    assert tb.advantages.tolist() == pytest.approx([0.5 / 0.5**0.5, -0.5 / 0.5**0.5], rel=1e-5)


def test_rows_trim_padding():
    batch = RolloutBatch(
        1, 2, [_sample(0, [1, 5], [6, 7, 2], 1.0), _sample(1, [1, 5, 8], [9], 0.0)]
    )
    mb = build_train_batch(batch, pad_id=0).rows(1, 2)
    assert mb.input_ids.tolist() == [[1, 5, 8, 9]]
    assert mb.loss_mask.tolist() == [[0, 0, 1]]


def test_rank_and_micro_batch_splits():
    assert [rank_slice(8, r, 2) for r in range(2)] == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="multiple of num_workers"):
        rank_slice(7, 0, 2)
    samples = [_sample(i, [1], [4 + i], float(i % 2)) for i in range(6)]
    tb = build_train_batch(RolloutBatch(1, 2, samples), pad_id=0)
    mbs = micro_batches(tb, 4)
    assert [m.size for m in mbs] == [4, 2]
    assert torch.equal(torch.cat([m.input_ids for m in mbs]), tb.input_ids)
