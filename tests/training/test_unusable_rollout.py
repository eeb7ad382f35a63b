"""A persisted rollout whose rewards give NaN advantages (a reward of
1e39 is finite in float64, inf in the trainer's float32) is refused before any
optimizer step: as a pure check of the batch builder, and through the real
train step, whose error names the rollout file and what to delete so that the
next run generates it again (every retry would otherwise reuse it)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import yaml
from train_helpers import synthetic_batch

from flows.config import load_config
from rollout.types import RolloutBatch
from tasks import steps
from tasks.context import RunContext
from training.batch import UnusableRollout, build_train_batch
from training.loss_config import LossConfig


def with_reward(batch: RolloutBatch, i: int, reward: float) -> RolloutBatch:
    samples = list(batch.samples)
    samples[i] = dataclasses.replace(samples[i], reward=reward)
    return dataclasses.replace(batch, samples=samples)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_a_reward_beyond_float32_is_refused_naming_the_sample(estimator):
    batch = with_reward(synthetic_batch(1), 5, 1e39)
    with pytest.raises(
        UnusableRollout,
        match=r"sample 5 of rollout batch 1 has reward 1e\+39, beyond the trainer's float32",
    ):
        build_train_batch(batch, 0, LossConfig(advantage=estimator))


def test_rewards_whose_sum_overflows_are_refused():
    # Each is a float32, but RLOO's group sum is not: the advantages come out inf/NaN.
    batch = with_reward(with_reward(synthetic_batch(1), 0, 3e38), 1, 3e38)
    with pytest.raises(
        UnusableRollout,
        match=r"sample 0 of rollout batch 1 has reward 3e\+38, which gives advantage "
        r"(nan|inf|-inf) \(rloo, float32\)",
    ):
        build_train_batch(batch, 0, LossConfig(advantage="rloo"))


def test_large_finite_rewards_still_train():
    batch = with_reward(synthetic_batch(1), 5, 1e6)
    full = build_train_batch(batch, 0, LossConfig(advantage="rloo"))
    assert bool(torch.isfinite(full.advantages).all())


def test_the_train_step_names_the_rollout_file_and_the_way_out(ray_cluster, tiny_model, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "poisoned"},
                "storage": {"root": str(tmp_path / "runs")},
                # A reward server (never called here): the error names it as the source.
                "rollout": {"reward": "http://127.0.0.1:9/score", "n_samples_per_prompt": 4},
                "train": {"num_cpus_per_worker": 0.5, "loss": {"advantage": "rloo"}},
            }
        )
    )
    ctx = RunContext(cfg=load_config(config), base_model_path=tiny_model)
    ctx.store.write_rollouts(1, with_reward(synthetic_batch(1), 5, 1e39).to_json())
    ctx.store.write_record(1, "rollout", {"result": {}})  # what a finished rollout[k=1] leaves
    try:
        with pytest.raises(UnusableRollout) as err:
            steps.train(ctx, 1)
    finally:
        ctx.trainer().shutdown()
    message = str(err.value)
    assert message.startswith(
        f"train[k=1] cannot use the persisted rollouts {ctx.store.rollouts_url(1)}: "
        "sample 5 of rollout batch 1 has reward 1e+39"
    ), message
    assert "rollout.reward 'http://127.0.0.1:9/score': fix it" in message
    run_dir = Path(ctx.store.url.removeprefix("file://"))
    named = re.search(r"delete (\S+), (\S+) and, if the run ran under Prefect, (\S+);", message)
    assert named, message
    # What the message says to delete is what exists (the Prefect result only under Prefect).
    assert (run_dir / named[1]).is_file() and (run_dir / named[2]).is_file()
    assert named[3] == "prefect-results/poisoned/1/rollout"
    assert ctx.store.read_record(1, "train") is None  # nothing committed, nothing trained
