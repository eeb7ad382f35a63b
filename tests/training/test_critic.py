"""PPO's critic through real Ray actors on the tiny model: its advantages feed the
policy's step, it learns its targets, and it is checkpointed and restored like
the policy (byte-identical after a rank dies and the group replays)."""

from __future__ import annotations

import math

import pytest
import ray
import torch
from train_helpers import synthetic_batch

from storage.run_store import RunStore
from training.config import (
    ModelConfig,
    RunIdentity,
    TrainConfig,
    TrainerSections,
    WeightsConfig,
)
from training.critic import CriticGroup
from training.critic_store import CriticStore
from training.group import TrainGroup


def _sections(storage_cfg, **train) -> TrainerSections:
    train = {"critic": {"lr": 1e-2}, **train}
    cfg = TrainConfig(micro_batch_size=6, lr=1e-2, loss={"advantage": "gae"}, **train)
    return TrainerSections(
        train=cfg, model=ModelConfig(), storage=storage_cfg, weights=WeightsConfig()
    )


def _groups(storage_cfg, run: str, **train) -> tuple[CriticGroup, TrainGroup]:
    identity = RunIdentity(name=run, seed=7, namespace="prefect-rl")
    sections = _sections(storage_cfg, **train)
    return (
        CriticGroup(identity, sections, placement=None, fence=None),
        TrainGroup(identity, sections, placement=None, fence=None),
    )


def _write_same_rollouts(storage_cfg, run: str, ks: range) -> None:
    """The same batch as rollouts of every k, so the critic's targets stay put."""
    store = RunStore(storage_cfg, run)
    batch = synthetic_batch(1).to_json()
    for k in ks:
        store.write_rollouts(k, {**batch, "iteration": k})


def _model_bytes(storage_cfg, run: str, k: int) -> bytes:
    with CriticStore(storage_cfg, run).open_checkpoint_file(k, "model.safetensors") as f:
        return f.read()


def test_policy_step_uses_the_critics_advantages(ray_cluster, tiny_model, storage_cfg):
    """The critic has ranks of its own (train.critic.num_workers): two beside one."""
    run = "ppo-step"
    _write_same_rollouts(storage_cfg, run, range(1, 2))
    critic, policy = _groups(storage_cfg, run, critic={"lr": 1e-2, "num_workers": 2})
    try:
        critic.create(tiny_model)
        policy.create(tiny_model)
        assert (len(critic.actors()), len(policy.actors())) == (2, 1)
        with pytest.raises(ray.exceptions.RayTaskError, match="run the critic's train\\(1\\)"):
            policy.train(1)  # the policy cannot run before the critic wrote rollout 1's advantages
        m_critic = critic.train(1)
        m_policy = policy.train(1)
    finally:
        critic.shutdown()
        policy.shutdown()
    adv = CriticStore(storage_cfg, run).read_advantages(1)
    batch = synthetic_batch(1)
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in batch.samples)
    assert tuple(adv.shape) == (len(batch.samples), longest - 1)
    responses = sum(len(s.response_ids) for s in batch.samples)
    assert int((adv != 0).sum()) <= responses  # only response tokens carry an advantage
    assert float(adv.sum()) == pytest.approx(0.0, abs=1e-3)  # whitened over the batch
    assert m_critic["response_tokens"] == responses == m_policy["response_tokens"]
    assert math.isfinite(m_policy["loss"]) and m_policy["grad_norm"] > 0


def test_critic_learns_its_targets(ray_cluster, tiny_model, storage_cfg):
    run = "ppo-learn"
    _write_same_rollouts(storage_cfg, run, range(1, 9))
    # lambda 1: the returns are the outcome rewards themselves, a fixed target.
    critic, _ = _groups(
        storage_cfg,
        run,
        pack_sequences=True,
        max_tokens_per_micro_batch=40,
        critic={"lr": 1e-3, "gae_lambda": 1.0},
    )
    try:
        critic.create(tiny_model)
        losses = [critic.train(k)["vf_loss"] for k in range(1, 9)]
    finally:
        critic.shutdown()
    assert losses[-1] < 0.5 * losses[0], losses


def test_critic_restores_and_replays_byte_identically(ray_cluster, tiny_model, storage_cfg):
    """Two ranks (FSDP over gloo): checkpoint 2, a rank dies after step 3, the
    group restores 2 and replays 3; step 4's checkpoint equals an uninterrupted run's."""
    for run in ("ppo-straight", "ppo-resumed"):
        _write_same_rollouts(storage_cfg, run, range(1, 5))
    straight, _ = _groups(storage_cfg, "ppo-straight", num_workers=2)
    try:
        straight.create(tiny_model)
        for k in range(1, 5):
            straight.train(k)
        straight.save(4)
    finally:
        straight.shutdown()
    resumed, _ = _groups(storage_cfg, "ppo-resumed", num_workers=2)
    try:
        resumed.create(tiny_model)
        resumed.train(1)
        resumed.train(2)
        resumed.save(2)
        resumed.train(3)
        ray.kill(resumed.actors()[1])
        report = resumed.ensure_state(3, tiny_model)
        resumed.train(4)
        resumed.save(4)
    finally:
        resumed.shutdown()
    assert (report["restored_from"], report["replayed"]) == (2, [3])
    # critic checkpoints live apart from the policy's
    assert RunStore(storage_cfg, "ppo-resumed").committed_checkpoints() == []
    assert CriticStore(storage_cfg, "ppo-resumed").committed_checkpoints() == [2, 4]
    assert _model_bytes(storage_cfg, "ppo-resumed", 4) == _model_bytes(
        storage_cfg, "ppo-straight", 4
    )
    # The two ranks score their own rows and gather them: as one rank scores them all.
    _write_same_rollouts(storage_cfg, "ppo-one-rank", range(1, 2))
    one, _ = _groups(storage_cfg, "ppo-one-rank")
    try:
        one.create(tiny_model)
        one.train(1)
    finally:
        one.shutdown()
    torch.testing.assert_close(
        CriticStore(storage_cfg, "ppo-straight").read_advantages(1),
        CriticStore(storage_cfg, "ppo-one-rank").read_advantages(1),
        rtol=1e-4,
        atol=1e-5,
    )
    for k in range(1, 5):
        a = CriticStore(storage_cfg, "ppo-straight").read_advantages(k)
        b = CriticStore(storage_cfg, "ppo-resumed").read_advantages(k)
        assert torch.equal(a, b), k


def test_ppo_on_colocated_devices_is_refused_at_load():
    """The critic takes devices of its own; the colocated bundles have none for it."""
    from flows.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="set placement.colocate: false for PPO"):
        load_config(None, {"train.loss.advantage": "gae", "placement.colocate": True})
