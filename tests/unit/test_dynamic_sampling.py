"""DAPO dynamic sampling (``rollout.dynamic_sampling``) through the rollout
procedure, against a fake engine group (engines need Ray; the procedure only
needs their ``generate_groups`` callable). The fake answers a prompt right in
every sample (a group of equal rewards) or in alternate samples, by the seed."""

from __future__ import annotations

from rollout.config import RolloutConfig
from rollout.dynamic_sampling import EXTRA_INDEX_BASE, ask, informative, sampling_row_fields
from rollout.procedure import generate_batch, summary
from tests.unit.test_procedure import FakeTokenizer


def seeded_generate_groups():
    """Right in every sample when the group's first seed is divisible by 3, else
    right in even samples only; records each call's prompt count."""
    calls: list[int] = []

    def generate_groups(prompts, n, sampling, seeds, restart_fn=None):
        calls.append(len(prompts))
        out = []
        for ids, group_seeds in zip(prompts, seeds):
            right = list(reversed(ids[:-1]))
            uniform = group_seeds[0] % 3 == 0
            group = []
            for j in range(n):
                reply = right if uniform or j % 2 == 0 else [ord("x")]
                meta = {
                    "weight_version": "2",
                    "finish_reason": {"type": "stop"},
                    "output_token_logprobs": [[-0.5, t] for t in reply],
                }
                group.append({"output_ids": reply, "meta_info": meta})
            out.append(group)
        return out

    return generate_groups, calls


def _run(cfg: RolloutConfig, k: int = 3):
    gen, calls = seeded_generate_groups()
    out = generate_batch(cfg, 11, k, 2, FakeTokenizer(), gen, restart=lambda i: None)
    return out.batch, calls


def test_groups_of_equal_rewards_are_replaced_until_the_batch_is_full():
    cfg = RolloutConfig(
        batch_size=8, n_samples_per_prompt=4, dynamic_sampling={"enabled": True, "max_rounds": 10}
    )
    batch, calls = _run(cfg)
    n = cfg.n_samples_per_prompt
    groups = [batch.samples[i : i + n] for i in range(0, len(batch.samples), n)]
    assert len(groups) == cfg.batch_size and all(informative(g) for g in groups)
    record = batch.sampling
    # The seed rule made 2 of the first 8 groups uniform: 6 kept of 8, 2 short. The
    # second round asks the gap over that keep rate, ceil(2 / (6/8)) = 3, and keeps
    # all 3: one more than the batch needed.
    assert calls == [8, 3] and record.rounds == 2
    assert record.prompts == 11 and record.dropped_groups == 2
    assert record.unused_groups == 1 and record.filled_uniform == 0
    # the rollout step's ledger result carries the record
    assert summary(batch, gen_s=1.0, reused=False)["sampling"]["rounds"] == record.rounds
    # The kept groups are half right (mean 0.5), the dropped ones all right: the metrics
    # row shows the policy's reward over everything generated beside the kept batch's.
    assert sum(batch.rewards) / len(batch.rewards) == 0.5
    kept = cfg.batch_size + record.unused_groups
    generated = (record.dropped_groups * 1.0 + kept * 0.5) / record.prompts
    assert record.reward_mean_generated == generated > 0.5
    row = sampling_row_fields(summary(batch, gen_s=1.0, reused=False)["sampling"])
    assert row == {"reward_mean_generated": generated, "sampling_rounds": record.rounds}
    # later rounds' prompts sit in a block of their own, never an iteration's regular one
    extra = {s.prompt_index for s in batch.samples if s.prompt_index >= EXTRA_INDEX_BASE}
    assert extra and len({s.prompt_index for s in batch.samples}) == cfg.batch_size
    # a retried rollout regenerates the very same batch, record included
    again, _ = _run(cfg)
    assert again.to_json() == batch.to_json()
    assert type(batch).from_json(batch.to_json()) == batch


def test_a_later_round_asks_the_gap_over_the_keep_rate_at_most_a_batch():
    assert ask(need=2, kept=6, asked=8, batch_size=8) == 3  # 2 / 0.75 = 2.67, up
    assert ask(need=4, kept=4, asked=8, batch_size=8) == 8  # half kept: twice the gap
    assert ask(need=6, kept=2, asked=8, batch_size=8) == 8  # 24 wanted, one batch at most
    assert ask(need=8, kept=0, asked=8, batch_size=8) == 8  # none kept: a full batch
    assert ask(need=1, kept=7, asked=8, batch_size=8) == 2  # 1 / 0.875 = 1.14, up


def test_a_batch_still_short_after_the_last_round_is_filled_with_dropped_groups():
    cfg = RolloutConfig(
        batch_size=8, n_samples_per_prompt=4, dynamic_sampling={"enabled": True, "max_rounds": 1}
    )
    batch, calls = _run(cfg)
    record = batch.sampling
    assert calls == [8] and record.rounds == 1
    assert record.filled_uniform == record.dropped_groups > 0
    assert len(batch.samples) == 8 * 4


def test_off_by_default_the_first_round_is_the_batch():
    batch, calls = _run(RolloutConfig(batch_size=8, n_samples_per_prompt=4))
    assert calls == [8] and batch.sampling is None
    assert "sampling" not in batch.to_json()  # persisted exactly as before the setting existed
    assert summary(batch, gen_s=1.0, reused=False)["sampling"] is None
    assert sampling_row_fields(None) == {}  # the metrics row has no sampling columns
