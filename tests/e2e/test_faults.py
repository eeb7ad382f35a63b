"""The fault-injection matrix: each step fails once, by (a) an exception, (b) its
Ray actor killed, (c) the flow process SIGKILLed and a new run started. Every
run finishes with final weights byte-identical to an uninterrupted run's, and no
committed record is lost or duplicated. (a) and (b) share one faulted run (here):
each fault sits at a (step, iteration) of its own, so every one is healed by its
step's own retries; (c) needs a process per fault (test_faults_sigkill.py, a
file of its own so that another xdist worker runs it beside this one). The
matrix's run, plans and checks are tests/e2e/fault_matrix.py. More rows live
beside their own fixtures: (d) a lost Ray node (tests/e2e/test_multinode.py), a
pipelined run (test_pipeline.py), each algorithm (test_algorithms.py) and
multi-turn rollouts (test_agentic.py)."""

from __future__ import annotations

import time

import pytest

from flows.config import load_config
from flows.driver import run_plain
from tests.e2e.fault_matrix import (
    BASE,
    KILL_PLAN,
    PLAN,
    assert_records_complete,
    final_weights,
    overrides,
)

pytestmark = pytest.mark.slow


def test_retries_heal_every_step(ray_cluster, prefect_api, matrix_reference, tmp_path):
    """Every step once by an exception and once by its killed actor, in one run."""
    from flows.rl_training import rl_training

    plans = {"exception": PLAN, "kill_actor": KILL_PLAN}
    assert not set(PLAN.items()) & set(KILL_PLAN.items())  # no two faults at one point
    faults = [
        {"step": s, "iteration": k, "kind": kind}
        for kind, plan in plans.items()
        for s, k in plan.items()
    ]
    over = overrides(tmp_path, "faults-retried", faults)
    state = rl_training(config_path=BASE, overrides=over, return_state=True)
    assert state.is_completed(), state
    from storage.run_store import RunStore

    store = RunStore(load_config(BASE, over).storage, over["run.name"])
    fired = sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(f"{store.url}/faults"))
    # every fault really fired, exactly once
    assert fired == sorted(f"{f['step']}-{f['iteration']:06d}-{f['kind']}" for f in faults), fired
    assert all(store.fs.cat_file(f"{store.url}/faults/{name}") == b"1" for name in fired)
    assert final_weights(store) == matrix_reference
    assert_records_complete(store)


# The release run's length: re-created from checkpoints 1 and 2, one that save_interval 2
# makes due and one it does not; each re-creation is a train actor start (a process
# importing torch), so the matrix's six iterations would add three without a new case.
RELEASED = 3


def test_release_after_publish_gives_the_same_weights(ray_cluster, matrix_versions, tmp_path):
    """slime's release_train: actors are killed after each publish and re-created
    from the checkpoint before the next train step; the result must not change."""
    over = {**overrides(tmp_path, "release"), "run.iterations": RELEASED}
    cfg = load_config(BASE, {**over, "train.release_after_publish": True})
    ctx, _, _ = run_plain(cfg, quiet=True)
    assert ctx.store.committed_checkpoints() == list(range(1, RELEASED + 1))
    assert final_weights(ctx.store, RELEASED) == matrix_versions[RELEASED]


# The outage run's length: down once train[2] commits, so the rerun finishes iteration 2
# and trains one more from what it restored; the matrix's later iterations add nothing.
OUTAGE = 3


def test_storage_outage_longer_than_retries_then_rerun(
    ray_cluster, prefect_api, matrix_versions, tmp_path
):
    """The S3 endpoint goes down mid-run for longer than the retries: the run
    fails clearly with nothing half-committed; once it is back, a rerun finishes."""
    import threading

    from moto.server import ThreadedMotoServer

    from flows.rl_training import rl_training
    from storage.run_store import RunStore
    from tests.s3_server import fake_aws_env, free_port, make_bucket

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    over = {
        **overrides(tmp_path, "outage"),
        "run.iterations": OUTAGE,
        "storage.root": "s3://outage-runs/exp",
        "storage.s3.endpoint_url": url,
        "storage.s3.max_attempts": 1,
        "weights.transport": "object-store",
        "engines.local_cache_dir": str(tmp_path / "cache"),
        "tasks.retries": 1,
    }
    cfg = load_config(BASE, over)
    with fake_aws_env():
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        make_bucket(url, "outage-runs")
        store = RunStore(cfg.storage, "outage")
        stopped = threading.Event()

        def stop_when_train_2_commits() -> None:
            # Each look is an S3 request to the moto server in this process, which
            # serves the run too: every 0.5 s until iteration 1 commits, then every
            # 0.05 s, as before (rollout[2] and train[2] take seconds after it).
            while not stopped.is_set() and store.read_record(1, "iteration") is None:
                time.sleep(0.5)
            while not stopped.is_set():
                if store.read_record(2, "train") is not None:
                    server.stop()
                    stopped.set()
                    return
                time.sleep(0.05)

        watcher = threading.Thread(target=stop_when_train_2_commits, daemon=True)
        watcher.start()
        state = rl_training(config_path=BASE, overrides=over, return_state=True)
        watcher.join(timeout=5)
        assert stopped.is_set()
        assert state.is_failed(), state
        # the endpoint comes back (moto keeps its objects in this process)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            for v in store.committed_versions():  # nothing half-committed: every version verifies
                store.pull_version(v, str(tmp_path / "verify-cache"))
            for c in store.committed_checkpoints():
                store.verify_checkpoint(c)
            state = rl_training(config_path=BASE, overrides=over, return_state=True)
            assert state.is_completed(), state
            assert final_weights(store, OUTAGE) == matrix_versions[OUTAGE]
            assert_records_complete(store, OUTAGE)
        finally:
            server.stop()
