"""Prefect as a user sees it: a real server, `prefect deploy --all` from
prefect.yaml, a process worker, `prefect deployment run ... --watch`, retries
from the API as the UI's Retry button does, and the maintenance deployments."""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e.services import Stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(ray_cluster, tmp_path_factory):
    # The flow runs the worker starts join the test session's Ray cluster (as they
    # would a long-lived cluster at ray.address), not a head started for this module.
    address = ray_cluster.get_runtime_context().gcs_address
    s = Stack(tmp_path_factory.mktemp("stack"), ray_address=address).start()
    try:
        s.deploy_and_start_worker()
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def client(stack):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: stack.api_url}):
        with get_client(sync_client=True) as c:
            yield c


def overrides(stack, root, name: str, **extra) -> dict:
    return {
        "run.name": name,
        "run.iterations": 2,
        "run.save_interval": 1,
        "storage.root": str(root),
        "rollout.batch_size": 4,
        "rollout.n_samples_per_prompt": 4,
        "engines.num_engines": 2,
        "engines.num_cpus_per_engine": 0.5,
        "train.num_cpus_per_worker": 0.5,
        "ray.address": stack.ray_address,
        "tasks.retry_delay_s": [0.1],
        **extra,
    }


def run_deployment(stack, name: str, params: dict, check: bool = True):
    return stack.cli(
        "deployment",
        "run",
        name,
        "--params",
        json.dumps(params),
        "--watch",
        "--watch-timeout",
        "900",
        timeout=1000,
        check=check,
    )


def flow_runs(client, deployment: str):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    flow, dep = deployment.split("/")
    return client.read_flow_runs(
        deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[dep]))
    )


def task_runs_named(client, prefix: str):
    return [t for t in client.read_task_runs(limit=200) if t.name.startswith(prefix)]


def store_of(root, name):
    from storage.config import StorageConfig
    from storage.run_store import RunStore

    return RunStore(StorageConfig(root=str(root)), name)


@pytest.fixture(scope="module")
def finished_run(stack, client, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    run_deployment(
        stack, "rl-training/tiny-cpu", {"params": {"overrides": overrides(stack, root, "e2e")}}
    )
    return root


def test_deployment_run_completes_with_names_artifacts_and_versions(stack, client, finished_run):
    runs = [r for r in flow_runs(client, "rl-training/tiny-cpu") if "e2e" in r.tags]
    assert runs and runs[0].state.is_completed()
    assert runs[0].name == "e2e:training"
    all_flow_names = {r.name for r in client.read_flow_runs(limit=200)}
    assert {"e2e:iter[k=1]", "e2e:iter[k=2]"} <= all_flow_names
    names = {t.name for t in task_runs_named(client, "e2e:")}
    for k in (1, 2):
        assert {
            f"e2e:rollout[k={k}]",
            f"e2e:train[k={k}]",
            f"e2e:save[k={k}]",
            f"e2e:publish[k={k}]",
            f"e2e:reload[k={k},engine=0]",
            f"e2e:reload[k={k},engine=1]",
            f"e2e:verify[k={k},engine=0]",
            f"e2e:verify[k={k},engine=1]",
        } <= names
    keys = {a.key for a in client.read_artifacts()}
    assert {"e2e-metrics", "e2e-progress", "e2e-summary", "e2e-reward-curve"} <= keys
    store = store_of(finished_run, "e2e")
    assert store.committed_versions() == [0, 1, 2]


def test_failed_run_retried_from_the_api_reexecutes_only_the_failed_step(stack, client, tmp_path):
    from prefect.states import Scheduled

    params = {
        "params": {
            "overrides": overrides(
                stack,
                tmp_path,
                "retry",
                **{
                    "run.iterations": 1,
                    "tasks.retries": 2,
                    "faults": [{"step": "reload", "iteration": 1, "times": 3}],
                },
            )
        }
    }
    out = run_deployment(stack, "rl-training/tiny-cpu", params, check=False)
    assert out.returncode != 0, "the injected reload fault should fail the run"
    store = store_of(tmp_path, "retry")
    before = {
        s: store.read_record(1, s)["committed_at"] for s in ("rollout", "train", "save", "publish")
    }
    assert store.read_record(1, "reload-e0") is None or store.read_record(1, "reload-e1") is None
    run = next(r for r in flow_runs(client, "rl-training/tiny-cpu") if "retry" in r.tags)
    assert run.state.is_failed()
    # What the UI's Retry button does: put the flow run back to Scheduled (AwaitingRetry).
    client.set_flow_run_state(run.id, Scheduled(name="AwaitingRetry"), force=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        state = client.read_flow_run(run.id).state
        if state.is_final():
            break
        time.sleep(2)
    assert state.is_completed(), state
    after = {s: store.read_record(1, s)["committed_at"] for s in before}
    assert after == before, "finished steps must not run again"
    assert store.committed_versions() == [0, 1]
    cached = {t.name for t in task_runs_named(client, "retry:") if t.state_name == "Cached"}
    assert {
        "retry:rollout[k=1]",
        "retry:train[k=1]",
        "retry:save[k=1]",
        "retry:publish[k=1]",
    } <= cached


def test_maintenance_deployments_and_rollback(stack, client, finished_run):
    ref = {"run_name": "e2e", "storage_root": str(finished_run)}
    run_deployment(stack, "publish-weights/publish-weights", {"params": {**ref, "checkpoint": 2}})
    run_deployment(stack, "reload-engines/reload-engines", {"params": {**ref, "version": 1}})
    store = store_of(finished_run, "e2e")
    assert store.serving_versions() == {0: 1, 1: 1}
    run_deployment(stack, "verify-engines/verify-engines", {"params": ref})
    run_deployment(stack, "gc-versions/gc-versions", {"params": {**ref, "keep_last": 2}})
    assert {1, 2} <= set(store.committed_versions())  # v1 is served, v2 is the newest
    # A later training iteration continues from the ledger, not from the rollback.
    run_deployment(
        stack,
        "rl-training/tiny-cpu",
        {"params": {"overrides": overrides(stack, finished_run, "e2e"), "extra_iterations": 1}},
    )
    batch = store.read_rollouts(3)
    assert {s["weight_version"] for s in batch["samples"]} == {2}
    assert store.committed_versions()[-1] == 3


@pytest.mark.parametrize(
    "deployment, params, message",
    [
        (
            "gc-versions/gc-versions",
            {"run_name": "e2e", "keep_last": 0},
            "less than the minimum of 1",
        ),
        ("verify-engines/verify-engines", {"run_name": "no-such-run"}, "no run 'no-such-run'"),
        (
            "reload-engines/reload-engines",
            {"run_name": "e2e", "version": 99},
            "version 99 of run 'e2e' is not committed",
        ),
    ],
)
def test_bad_input_is_refused_before_work(stack, client, finished_run, deployment, params, message):
    params = {"storage_root": str(finished_run), **params}
    out = run_deployment(stack, deployment, {"params": params}, check=False)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    if message not in text:  # the flow failed: its message is in the flow run's state
        runs = [r for r in flow_runs(client, deployment) if r.state and r.state.is_failed()]
        text += " ".join(r.state.message or "" for r in runs)
    assert message in text
