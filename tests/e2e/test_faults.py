"""The fault-injection matrix: each step fails once, by (a) an exception, (b) its
Ray actor killed, (c) the flow process SIGKILLed and a new run started. Every
run finishes with final weights byte-identical to an uninterrupted run's, and no
committed record is lost or duplicated. (a) and (b) share one faulted run: each
fault sits at a (step, iteration) of its own, so every one is healed by its
step's own retries; (c) needs a process per fault. More rows live beside their
own fixtures: (d) a lost Ray node (tests/e2e/test_multinode.py), a pipelined
run (test_pipeline.py), each algorithm (test_algorithms.py) and multi-turn
rollouts (test_agentic.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.config import load_config
from flows.driver import run_plain
from tests.e2e.services import kill_session, session_pids

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 6
# One step per iteration; save is due at even iterations (save_interval 2).
BASE = "configs/tiny-cpu.yaml"  # every run here: this file plus overrides
# save_background fires inside the background checkpoint write of a due save (2, 4).
PLAN = {
    "rollout": 1,
    "save": 2,
    "train": 3,
    "publish": 4,
    "reload": 5,
    "verify": 6,
    "save_background": 4,
}
# The killed actors, in the same run as PLAN's exceptions: no (step, iteration) of both.
KILL_PLAN = {
    "rollout": 2,
    "save": 4,
    "train": 5,
    "publish": 6,
    "reload": 1,
    "verify": 3,
    "save_background": 2,
}


def overrides(root: Path, name: str, faults: list[dict] | None = None) -> dict:
    return {
        "run.name": name,
        "run.iterations": ITERATIONS,
        "run.save_interval": 2,
        "storage.root": str(root),
        "storage.lease_ttl_s": 3,
        "rollout.batch_size": 4,
        "rollout.n_samples_per_prompt": 4,
        "engines.num_cpus_per_engine": 0.5,
        "train.num_cpus_per_worker": 0.5,
        "tasks.retries": 2,
        "tasks.retry_delay_s": [0.1],
        "faults": faults or [],
    }


def final_weights(store) -> dict[str, str]:
    manifest = store.read_manifest(ITERATIONS)
    return {f.name: f.sha256 for f in manifest.files if f.name.endswith(".safetensors")}


def assert_records_complete(store) -> None:
    for k in range(1, ITERATIONS + 1):
        steps = set(store.committed_steps(k))
        assert {"rollout", "train", "save", "publish", "reload-e0", "iteration"} <= steps, (
            k,
            steps,
        )
    assert [m["iteration"] for m in store.read_metrics()] == list(range(1, ITERATIONS + 1))
    metrics_lines = store.fs.cat_file(f"{store.url}/metrics.jsonl").decode().strip().splitlines()
    assert len(metrics_lines) == ITERATIONS


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory) -> dict[str, str]:
    cfg = load_config(BASE, overrides(tmp_path_factory.mktemp("ref"), "ref"))
    ctx, _, _ = run_plain(cfg, quiet=True)
    return final_weights(ctx.store)


def test_retries_heal_every_step(ray_cluster, prefect_api, reference, tmp_path):
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
    assert final_weights(store) == reference
    assert_records_complete(store)


def describe(pids: list[int]) -> str:
    out = []
    for pid in pids:
        try:
            out.append(f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:120]!r}")
        except OSError:
            pass
    return "\n".join(out)


def wait_for_empty_session(sid: int, timeout: float = 90) -> list[int]:
    """The processes left in session ``sid`` once they stop ending (or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    while (left := session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_sigkilled_flow_process_resumes_and_leaves_nothing_running(
    ray_cluster, prefect_api, reference, tmp_path
):
    """Each step's SIGKILL, then a rerun. The first run is a user's first command: no
    PREFECT_API_URL (Prefect's temporary server) and a local Ray cluster; everything it
    started ends with it. The later runs join the session's server and Ray cluster."""
    from engines.group import EngineGroup

    faults = [{"step": s, "iteration": k, "kind": "sigkill"} for s, k in PLAN.items()]
    over = overrides(tmp_path, "faults-sigkill", faults)
    cli = [str(Path(sys.executable).parent / "prefect-rl"), "run", BASE]
    for key, value in over.items():
        cli += ["--set", f"{key}={json.dumps(value)}"]  # JSON is YAML
    alone = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    alone["PREFECT_HOME"] = str(tmp_path / "prefect-home")  # no profile's server either
    # Prefect's temporary server gets 20 s to start by default; a loaded 2-core CI
    # machine once took longer ("Timed out while attempting to connect").
    alone["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "90"
    shared = {**os.environ, "PREFECT_API_URL": prefect_api}
    joined = ["--set", f"ray.address={ray_cluster.get_runtime_context().gcs_address}"]
    codes = []
    for attempt in range(len(PLAN) + 2):
        first = attempt == 0
        proc = subprocess.Popen(
            cli if first else cli + joined,
            cwd=ROOT,
            env=alone if first else shared,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=600)
            left = wait_for_empty_session(proc.pid) if first else []
        finally:
            proc.kill()
            kill_session(proc.pid)
        codes.append(proc.returncode)
        if first:
            # The temporary Prefect server, the local Ray cluster (GCS, raylet,
            # agents, workers) and the engines all ended with the killed run.
            assert proc.returncode == -9, err[-3000:]
            assert left == [], f"left running after the SIGKILL:\n{describe(left)}"
        if proc.returncode == 0:
            break
        assert proc.returncode == -9, err[-3000:]
    assert codes == [-9] * len(PLAN) + [0], codes
    from storage.run_store import RunStore

    cfg = load_config(BASE, over)
    store = RunStore(cfg.storage, over["run.name"])
    assert final_weights(store) == reference
    assert_records_complete(store)
    # On a cluster at ray.address the engines outlive the run (they serve its last version).
    EngineGroup(cfg.run.name, cfg.engines, namespace=cfg.ray.namespace).shutdown()


def test_release_after_publish_gives_the_same_weights(ray_cluster, reference, tmp_path):
    """slime's release_train: actors are killed after each publish and re-created
    from the checkpoint before the next train step; the result must not change."""
    cfg = load_config(BASE, {**overrides(tmp_path, "release"), "train.release_after_publish": True})
    ctx, _, _ = run_plain(cfg, quiet=True)
    assert ctx.store.committed_checkpoints() == list(range(1, ITERATIONS + 1))
    assert final_weights(ctx.store) == reference


def test_storage_outage_longer_than_retries_then_rerun(
    ray_cluster, prefect_api, reference, tmp_path
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
            assert final_weights(store) == reference
            assert_records_complete(store)
        finally:
            server.stop()
