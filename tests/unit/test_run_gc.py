"""Retention over a whole run (``RunContext.gc``, what the finish step and the
gc-versions flow call): PPO's critic checkpoints follow the policy's keep_last."""

from __future__ import annotations

from flows.config import load_config
from tasks import maintenance
from tasks.context import RunContext
from training.critic import CriticStore


def _checkpoint(store, k: int) -> None:
    writer = store.checkpoint_writer(k)
    with writer.open("model.safetensors") as f:
        f.write(b"weights of iteration %d" % k)
    writer.commit({"iteration": k})


def test_gc_keeps_the_critics_last_checkpoints_as_the_policys(tmp_path):
    over = {"storage.root": str(tmp_path), "run.name": "ppo-gc", "train.loss.advantage": "gae"}
    ctx = RunContext(load_config(None, over), base_model_path=str(tmp_path / "base"))
    critic = CriticStore(ctx.cfg.storage, ctx.run_name)
    for k in (1, 2, 3):
        _checkpoint(ctx.store, k)
        _checkpoint(critic, k)
    report = maintenance.collect_garbage.fn(ctx, keep_last=1)
    assert ctx.store.committed_checkpoints() == critic.committed_checkpoints() == [3]
    assert report["deleted_checkpoints"] == report["critic"]["deleted_checkpoints"] == [1, 2]


def test_without_a_critic_gc_touches_no_critic_folder(tmp_path):
    ctx = RunContext(
        load_config(None, {"storage.root": str(tmp_path), "run.name": "grpo-gc"}),
        base_model_path=str(tmp_path / "base"),
    )
    for k in (1, 2):
        _checkpoint(ctx.store, k)
    report = maintenance.collect_garbage.fn(ctx, keep_last=1)
    assert "critic" not in report and ctx.store.committed_checkpoints() == [2]
