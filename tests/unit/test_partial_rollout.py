"""Partial rollouts (``rollout.partial``) against a fake engine group, as
``test_procedure.py`` does: the head, the rows the continuation sends, its seeds,
each token's version and the check of the version that continued. The real
engines run it end to end in ``tests/e2e/test_pipeline.py``."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rollout.config import RolloutConfig
from rollout.partial import continue_batch, generate_head
from rollout.procedure import VersionMismatch
from rollout.seeding import chunk_seed, sample_seed
from rollout.types import RolloutBatch
from tests.unit.test_procedure import FakeTokenizer

CFG = RolloutConfig(
    batch_size=2,
    n_samples_per_prompt=2,
    max_new_tokens=6,
    max_staleness=2,
    partial=True,
    partial_chunk=2,
)


def fake_engine(served: int):
    """A fake engine serving ``served``: each row's tokens count up from its last id."""
    calls = []

    def answer(row: list[int], params: dict) -> dict:
        n = params["max_new_tokens"]
        ids = [row[-1] + 1 + t for t in range(n)]
        meta = {
            "weight_version": str(served),
            "finish_reason": {"type": "length"},
            "output_token_logprobs": [[-0.1 * served, t] for t in ids],
        }
        return {"output_ids": ids, "meta_info": meta}

    def generate_groups(prompts, n, sampling, seeds, restart_fn=None):
        calls.append(("groups", sampling, seeds))
        return [[answer(p, sampling) for _ in range(n)] for p in prompts]

    def generate_rows(rows, params, restart_fn=None):
        calls.append(("rows", rows, params))
        return [[answer(r, p) for r, p in zip(rs, ps)] for rs, ps in zip(rows, params)]

    return generate_groups, generate_rows, calls


def test_the_head_is_the_first_chunk_sampled_as_the_whole_batch_would_be():
    groups, _, calls = fake_engine(served=3)
    head = generate_head(CFG, 7, 5, 3, FakeTokenizer(), groups, restart=lambda i: None).batch
    assert {len(s.response_ids) for s in head.samples} == {2}  # partial_chunk
    assert {s.weight_version for s in head.samples} == {3} and all(
        s.reward == 0 for s in head.samples
    )
    _, sampling, seeds = calls[0]
    assert sampling["max_new_tokens"] == 2
    p = head.samples[0].prompt_index
    assert seeds[0] == [sample_seed(7, 5, p, j) for j in range(2)]  # the batch's own seeds


def test_the_rest_continues_each_unfinished_sample_on_the_newer_version():
    groups, rows, calls = fake_engine(served=3)
    head = generate_head(CFG, 7, 5, 3, FakeTokenizer(), groups, restart=lambda i: None).batch
    _, rows, calls = fake_engine(served=4)
    out = continue_batch(CFG, 7, head, 4, FakeTokenizer(), rows, restart=lambda i: None).batch
    _, sent, params = calls[0]
    s0 = head.samples[0]
    assert sent[0][0] == s0.prompt_ids + s0.response_ids  # the prompt and its head, re-read
    seed = chunk_seed(7, 5, s0.prompt_index, s0.sample_index, 1)
    assert params[0][0]["max_new_tokens"] == 4 and params[0][0]["sampling_seed"] == seed
    for h, s in zip(head.samples, out.samples):
        assert s.response_ids[:2] == h.response_ids and len(s.response_ids) == 6
        assert s.token_versions == [3, 3, 4, 4, 4, 4] and s.versions == [3, 4]
        assert s.response_logprobs[:2] == h.response_logprobs
        assert s.response_logprobs[2:] == [pytest.approx(-0.4)] * 4  # the newer version's own
    assert RolloutBatch.from_json(out.to_json()) == out  # persisted with the token versions


def test_a_sample_that_stopped_in_its_head_is_not_continued():
    groups, _, _ = fake_engine(served=3)
    head = generate_head(CFG, 7, 5, 3, FakeTokenizer(), groups, restart=lambda i: None).batch
    stopped = replace(head.samples[0], finish_reason="stop")  # an end of sequence in the head
    head = replace(head, samples=[stopped, *head.samples[1:]])
    _, rows, calls = fake_engine(served=4)
    out = continue_batch(CFG, 7, head, 4, FakeTokenizer(), rows, restart=lambda i: None).batch
    assert sum(len(r) for r in calls[0][1]) == 3  # the other three were sent on
    assert out.samples[0].response_ids == stopped.response_ids
    assert out.samples[0].token_versions == [3, 3] and out.samples[0].finish_reason == "stop"


def test_a_continuation_from_another_version_fails_the_rollout():
    groups, _, _ = fake_engine(served=3)
    head = generate_head(CFG, 7, 5, 3, FakeTokenizer(), groups, restart=lambda i: None).batch
    _, rows, _ = fake_engine(served=3)  # the engines were not reloaded to v4
    with pytest.raises(VersionMismatch, match="continuation came from weights v3, expected v4"):
        continue_batch(CFG, 7, head, 4, FakeTokenizer(), rows, restart=lambda i: None)
