"""Retention over a whole run (``RunContext.gc``, what the finish step and the
gc-versions flow call): PPO's critic checkpoints follow the policy's keep_last."""

from __future__ import annotations

from flows.config import load_config
from tasks.context import RunContext
from training.critic_store import CriticStore


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
    report = ctx.gc(keep_last=1)
    assert ctx.store.committed_checkpoints() == critic.committed_checkpoints() == [3]
    assert report["deleted_checkpoints"] == report["critic"]["deleted_checkpoints"] == [1, 2]


def test_without_a_critic_gc_touches_no_critic_folder(tmp_path):
    ctx = RunContext(
        load_config(None, {"storage.root": str(tmp_path), "run.name": "grpo-gc"}),
        base_model_path=str(tmp_path / "base"),
    )
    for k in (1, 2):
        _checkpoint(ctx.store, k)
    report = ctx.gc(keep_last=1)
    assert "critic" not in report and ctx.store.committed_checkpoints() == [2]


def test_retention_runs_behind_the_commit_and_the_lease_waits_for_it(tmp_path, monkeypatch):
    """The finish step starts a pass and returns; the lease is released after it ends."""
    import threading

    from tasks import retention
    from tasks.lease import LeaseKeeper
    from tasks.prepare import take_lease

    over = {"storage.root": str(tmp_path), "run.name": "bg-gc"}
    ctx = take_lease(RunContext(load_config(None, over), base_model_path=str(tmp_path / "b")))
    for k in (1, 2, 3):
        _checkpoint(ctx.store, k)
    gate, real = threading.Event(), RunContext.gc
    monkeypatch.setattr(RunContext, "gc", lambda self, n: gate.wait(30) and real(self, n))
    keeper = LeaseKeeper(ctx).__enter__()
    assert retention.start(ctx, 1) == []
    assert ctx.store.committed_checkpoints() == [1, 2, 3]  # returned before deleting
    threading.Timer(0.2, gate.set).start()
    keeper.__exit__(None, None, None)  # waits for the pass, then releases
    assert ctx.store.committed_checkpoints() == [3]
    assert ctx.store.read_lease().released


def test_a_failed_retention_pass_is_a_warning_of_the_next_and_loses_nothing(tmp_path, monkeypatch):
    from storage.errors import StorageError
    from tasks import retention

    over = {"storage.root": str(tmp_path), "run.name": "bad-gc"}
    ctx = RunContext(load_config(None, over), base_model_path=str(tmp_path / "b"))
    for k in (1, 2):
        _checkpoint(ctx.store, k)
    real = RunContext.gc

    def outage(self, keep_last):
        raise StorageError("the store answered 503")

    monkeypatch.setattr(RunContext, "gc", outage)
    assert retention.start(ctx, 1) == []
    monkeypatch.setattr(RunContext, "gc", real)
    (warning,) = retention.start(ctx, 1)  # the next iteration's pass reports it, and runs
    assert "503" in warning and "gc-versions" in warning
    assert retention.wait(ctx) == [] and ctx.store.committed_checkpoints() == [2]
