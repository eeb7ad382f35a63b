"""A tiny run end to end on real Ray actors, through the plain driver and the
Prefect flow: versions committed, engines verified, resume and completion."""

from __future__ import annotations

import json

import pytest

from flows.config import load_config
from flows.driver import run_plain
from tasks import steps
from tasks.prepare import prepare_run
from tasks.serving.transports import engine_weights


def tiny_cfg(tmp_path, name: str, **extra):
    overrides = {
        "run.name": name,
        "run.iterations": 2,
        "run.save_interval": 1,
        "storage.root": str(tmp_path / "runs"),
        "rollout.batch_size": 4,
        "rollout.n_samples_per_prompt": 4,
        "engines.num_cpus_per_engine": 0.5,
        "train.num_cpus_per_worker": 0.5,
        "tasks.retry_delay_s": [0.1],
    }
    overrides.update(extra)
    return load_config(None, overrides)


@pytest.fixture(scope="module")
def plain_run(ray_cluster, tmp_path_factory):
    """One plain run of 2 iterations on 2 engines, its actors left up, shared by the
    three tests below (every actor start is a process importing torch). They run in
    file order: the last one continues the run."""
    tmp = tmp_path_factory.mktemp("plain")
    # Below temperature 1, so the engines' logprobs and the trainer's agree only if
    # both score the batch at the temperature it was sampled at.
    cfg = tiny_cfg(tmp, "plain", **{"engines.num_engines": 2, "rollout.temperature": 0.7})
    ctx, rows, _ = run_plain(cfg, quiet=True, keep_actors=True)
    yield tmp, cfg, ctx, rows
    ctx.trainer().shutdown()
    ctx.engines().shutdown()


def test_publish_writes_manifest_last(plain_run):
    _, _, ctx, _ = plain_run
    vdir = ctx.store.local_version_dir(1)
    manifest = json.loads(open(f"{vdir}/manifest.json").read())
    names = {f["name"] for f in manifest["files"]}
    assert "config.json" in names and any(n.endswith(".safetensors") for n in names)
    import os

    mtimes = {n: os.stat(f"{vdir}/{n}").st_mtime_ns for n in names}
    assert os.stat(f"{vdir}/manifest.json").st_mtime_ns >= max(mtimes.values())


def test_verify_fails_when_an_engine_is_left_on_an_old_version(ray_cluster, plain_run):
    _, cfg, _, _ = plain_run
    ctx = prepare_run(cfg)
    for e in (0, 1):
        assert steps.verify_engine(ctx, 2, e)["verified"]
    handle = ctx.engines().handle(1)
    reply = ray_cluster.get(
        handle.update_weights_from_disk.remote(engine_weights(ctx, ctx.engines(), 1, 1).path, "1")
    )
    assert reply["success"]
    assert steps.verify_engine(ctx, 2, 0)["verified"]
    with pytest.raises(
        steps.VersionMismatch, match="engine 1 serves weight version '1', expected '2'"
    ):
        steps.verify_engine(ctx, 2, 1)


def test_plain_run_commits_versions_and_resumes(plain_run):
    tmp, cfg, ctx, rows = plain_run
    store = ctx.store
    assert [r["iteration"] for r in rows] == [1, 2]
    assert store.committed_versions() == [0, 1, 2]
    assert [m["iteration"] for m in store.read_metrics()] == [1, 2]
    run_json = store.read_run_json()
    assert run_json["config"]["run"]["name"] == "plain"
    # every sample of rollout k came from version k-1, at the configured temperature,
    # and the trainer scored it there: the engines' logprobs are its own (fp32 both)
    for k in (1, 2):
        batch = store.read_rollouts(k)
        assert {s["weight_version"] for s in batch["samples"]} == {k - 1}
        assert batch["temperature"] == 0.7
    assert all(r["rollout_logprob_kl"] <= 1e-6 for r in rows)
    assert [r["rollout_logprob_kl_over"] for r in rows] == [False, False]
    # a second run of a finished run does nothing (and ends the actors, as a run does)
    _, rows_again, _ = run_plain(cfg, quiet=True)
    assert rows_again == []
    # more iterations continue from the last one, on new actors (one engine now),
    # keeping the last two versions: retention runs behind finish[3]'s commit and
    # has ended by the time the run (and its lease) has
    more = {"run.iterations": 3, "storage.keep_last": 2}
    ctx3, rows3, _ = run_plain(tiny_cfg(tmp, "plain", **more), quiet=True)
    assert [r["iteration"] for r in rows3] == [3]
    assert ctx3.store.committed_versions() == [2, 3]
    assert ctx3.store.committed_checkpoints() == [2, 3]
    assert ctx3.store.read_lease().released
    assert "retention" in store.read_record(3, "iteration")["phases"]
    assert store.read_record(1, "train")["result"]["loss"] == rows[0]["loss"]


def test_flow_run_runs_every_step_as_a_task_run_and_resumes(ray_cluster, prefect_api, tmp_path):
    from flows.rl_training import rl_training

    overrides = {
        "run.name": "flow",
        "run.iterations": 2,
        "storage.root": str(tmp_path / "runs"),
        "rollout.batch_size": 4,
        "rollout.n_samples_per_prompt": 4,
        "engines.num_engines": 2,
        "engines.num_cpus_per_engine": 0.5,
        "train.num_cpus_per_worker": 0.5,
    }
    state = rl_training(config_path="configs/tiny-cpu.yaml", overrides=overrides, return_state=True)
    assert state.is_completed(), state
    out = state.result()
    assert out["iterations"] == [1, 2]
    cfg = load_config("configs/tiny-cpu.yaml", overrides)
    from storage.run_store import RunStore

    store = RunStore(cfg.storage, "flow")
    assert store.committed_versions() == [0, 1, 2]
    for k in (1, 2):
        assert {
            "rollout",
            "train",
            "save",
            "publish",
            "reload-e0",
            "reload-e1",
            "iteration",
        } <= set(store.committed_steps(k))
    # a finished run reports complete and does nothing
    again = rl_training(config_path="configs/tiny-cpu.yaml", overrides=overrides)
    assert again["iterations"] == []
