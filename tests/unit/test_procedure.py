"""The rollout procedure (``rollout.procedure``) against a fake engine group:
the engines are impossible here without Ray, and the procedure only needs
their ``generate_groups`` callable."""

from __future__ import annotations

import pytest

from rollout.config import RolloutConfig
from rollout.procedure import VersionMismatch, generate_batch
from rollout.seeding import sample_seed


class FakeTokenizer:
    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def fake_generate_groups(served: int):
    """Answers each prompt with its own reversed text, from weights ``served``."""
    calls = []

    def generate_groups(prompts, n, sampling, seeds, restart_fn=None):
        calls.append((sampling, seeds))
        out = []
        for ids in prompts:
            reply = list(reversed(ids[:-1]))
            meta = {
                "weight_version": str(served),
                "finish_reason": {"type": "stop"},
                "output_token_logprobs": [[-0.5, t] for t in reply],
            }
            out.append([{"output_ids": reply, "meta_info": meta}] * n)
        return out

    return generate_groups, calls


def test_samples_are_seeded_scored_and_carry_their_version():
    cfg = RolloutConfig(batch_size=2, n_samples_per_prompt=3)
    gen, calls = fake_generate_groups(served=4)
    out = generate_batch(cfg, 7, 5, 4, FakeTokenizer(), gen, restart=lambda i: None)
    batch = out.batch
    assert (batch.iteration, len(batch.samples)) == (5, 6)
    assert {s.weight_version for s in batch.samples} == {4}
    assert all(s.reward == 1.0 for s in batch.samples)  # the reverse task, answered right
    sampling, seeds = calls[0]
    assert sampling == {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": cfg.max_new_tokens}
    first = batch.samples[0].prompt_index
    assert seeds[0] == [sample_seed(7, 5, first, j) for j in range(3)]


def test_a_sample_from_another_version_fails_the_rollout():
    gen, _ = fake_generate_groups(served=3)
    with pytest.raises(VersionMismatch, match="expected v4; the engines were not reloaded"):
        generate_batch(
            RolloutConfig(batch_size=1), 0, 5, 4, FakeTokenizer(), gen, restart=lambda i: None
        )
