"""Prefect as a user sees it: a real server, `prefect deploy --all` from
prefect.yaml, a process worker, `prefect deployment run ... --watch`, retries
from the API as the UI's Retry button does, and the maintenance deployments
(`--param version=1`), which refuse bad input before they take the lease."""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e.services import worker_stack

pytestmark = pytest.mark.slow


ENGINES = 2  # of every training run here
# The training runs of this module: on a cluster at ray.address their engines outlive
# them (they serve the run's last version).
RUNS = ("e2e", "retry")


@pytest.fixture(scope="module")
def stack(ray_cluster, prefect_server, tmp_path_factory):
    # The flow runs the worker starts join the test session's Ray cluster (as they
    # would a long-lived cluster at ray.address), not a head started for this module,
    # and report to the session's Prefect server.
    from engines.config import EngineConfig
    from engines.group import EngineGroup

    address = ray_cluster.get_runtime_context().gcs_address
    with worker_stack(tmp_path_factory.mktemp("stack"), address, prefect_server) as s:
        yield s
    # The engines the runs left end with the module, as an operator ends a run's
    # engines on a long-lived cluster: left up, four idle engine processes held a
    # quarter of the session cluster's CPUs, and their CPU time, to the session's end.
    for name in RUNS:
        EngineGroup(name, EngineConfig(num_engines=ENGINES)).shutdown()


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
        "engines.num_engines": ENGINES,
        "engines.num_cpus_per_engine": 0.5,
        "train.num_cpus_per_worker": 0.5,
        "ray.address": stack.ray_address,
        "tasks.retry_delay_s": [0.1],
        **extra,
    }


def training(**params) -> dict:
    """rl-training's parameters (top-level: ``--param extra_iterations=1`` works too)."""
    return params


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


def run_maintenance(stack, name: str, check: bool = True, **params):
    """As docs/prefect.md writes it: one ``--param key=value`` per parameter."""
    flags = [arg for k, v in params.items() for arg in ("--param", f"{k}={v}")]
    args = ["deployment", "run", name, *flags, "--watch", "--watch-timeout", "900"]
    return stack.cli(*args, timeout=1000, check=check)


def flow_runs(client, deployment: str):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    flow, dep = deployment.split("/")
    return client.read_flow_runs(
        deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[dep]))
    )


def task_runs_named(client, prefix: str):
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    named = TaskRunFilter(name=TaskRunFilterName(like_=prefix))
    return [t for t in client.read_task_runs(task_run_filter=named) if t.name.startswith(prefix)]


def flow_run_logs(client, flow_run_id) -> str:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return "\n".join(log.message for log in logs)


def store_of(root, name):
    from storage.config import StorageConfig
    from storage.run_store import RunStore

    return RunStore(StorageConfig(root=str(root)), name)


@pytest.fixture(scope="module")
def finished_run(stack, client, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    run_deployment(stack, "rl-training/tiny-cpu", {"overrides": overrides(stack, root, "e2e")})
    return root


def test_deployment_run_completes_with_names_artifacts_and_versions(stack, client, finished_run):
    runs = [r for r in flow_runs(client, "rl-training/tiny-cpu") if "e2e" in r.tags]
    assert runs and runs[0].state.is_completed()
    assert runs[0].name == "e2e:training"
    # An iteration is its task runs (no subflow), named by k.
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
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    # The session's server holds other tests' artifacts too: only this run's keys.
    mine = ArtifactFilter(key=ArtifactFilterKey(like_="e2e-"))
    keys = {a.key for a in client.read_artifacts(artifact_filter=mine)}
    assert {"e2e-metrics", "e2e-progress", "e2e-summary", "e2e-reward-curve"} <= keys
    store = store_of(finished_run, "e2e")
    assert store.committed_versions() == [0, 1, 2]


def test_evaluate_versions_runs_as_a_deployment(stack, client, finished_run):
    """The worker runs evaluate-versions on the trained run's newest version: its own
    engine, 4 prompts in one shard on RayTaskRunner, the record under the run's evals/
    and the table artifact (before the maintenance test below deletes versions)."""
    ref = {"run_name": "e2e", "storage_root": str(finished_run)}
    dep = "evaluate-versions/evaluate-versions"
    sizes = {"size": 4, "n_samples": 2, "shard_size": 4, "num_engines": 1, "shard_cpus": 0.5}
    run_maintenance(stack, dep, **ref, versions="newest 1", dataset="reverse", **sizes)
    [run] = flow_runs(client, dep)
    assert run.state.is_completed() and "e2e" in run.tags
    record = json.loads((finished_run / "e2e" / "evals" / "reverse-4-n2-t1.json").read_text())
    assert list(record["versions"]) == ["2"] and record["shards"] == 1
    assert record["versions"]["2"]["prompts"] == 4
    [table] = client.read_artifacts(artifact_filter=_key("e2e-eval-reverse-4-n2-t1"))
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert table.type == "table" and [row["version"] for row in rows] == [2]


def _key(key: str):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    return ArtifactFilter(key=ArtifactFilterKey(any_=[key]))


def test_failed_run_retried_from_the_api_reexecutes_only_the_failed_step(stack, client, tmp_path):
    """A pipelined run (rollout[2] is made beside train[1]) fails at reload[1];
    Retry re-executes reload and what follows, never the steps that finished."""
    from prefect.states import Scheduled

    params = {
        "overrides": overrides(
            stack,
            tmp_path,
            "retry",
            **{
                "run.iterations": 2,
                "rollout.max_staleness": 1,
                "tasks.retries": 2,
                # Two engines share the counter: 6 failures exhaust both reloads' 3 attempts.
                "faults": [{"step": "reload", "iteration": 1, "times": 6}],
            },
        )
    }
    out = run_deployment(stack, "rl-training/tiny-cpu", params, check=False)
    assert out.returncode != 0, "the injected reload fault should fail the run"
    store = store_of(tmp_path, "retry")
    before = {
        s: store.read_record(1, s)["committed_at"] for s in ("rollout", "train", "save", "publish")
    }
    ahead = store.read_record(2, "rollout")["committed_at"]  # made beside train[1]
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
        time.sleep(0.25)  # one API read per look: the retried run ends in ~10 s
    assert state.is_completed(), state
    after = {s: store.read_record(1, s)["committed_at"] for s in before}
    assert after == before, "finished steps must not run again"
    assert store.read_record(2, "rollout")["committed_at"] == ahead
    assert store.committed_versions() == [0, 1, 2]
    cached = {t.name for t in task_runs_named(client, "retry:") if t.state_name == "Cached"}
    assert {
        "retry:rollout[k=1]",
        "retry:train[k=1]",
        "retry:save[k=1]",
        "retry:publish[k=1]",
        "retry:rollout[k=2]",
    } <= cached


def test_maintenance_deployments_and_rollback(stack, client, finished_run):
    import shutil

    ref = {"run_name": "e2e", "storage_root": str(finished_run)}
    store = store_of(finished_run, "e2e")
    run_maintenance(stack, "reload-engines/reload-engines", **ref, version=1)
    assert store.serving_versions() == {0: 1, 1: 1}
    run_maintenance(stack, "verify-engines/verify-engines", **ref)
    run_maintenance(stack, "gc-versions/gc-versions", **ref, keep_last=1)
    assert store.committed_versions() == [1, 2]  # v1 is served, v2 is the newest
    assert store.committed_checkpoints() == [2]
    # v2's folder is lost; its checkpoint is kept: publish it again from there.
    shutil.rmtree(store.local_version_dir(2))
    run_maintenance(stack, "publish-weights/publish-weights", **ref, checkpoint=2)
    assert store.committed_versions() == [1, 2]
    lease = store.read_lease()
    assert lease is None or lease.released  # every maintenance run released it
    for deployment, says in [
        ("reload-engines/reload-engines", "engine 1 of run 'e2e' serves v1 (was v2)"),
        ("verify-engines/verify-engines", "engine 0 of run 'e2e' serves v1, as recorded"),
        ("gc-versions/gc-versions", "deleted versions [0] and checkpoints [1]"),
        ("gc-versions/gc-versions", "kept v1 beyond keep_last: served by engine 0"),
        ("publish-weights/publish-weights", "published checkpoint 2 of run 'e2e' as v2"),
    ]:
        # Each run carries the run name: the UI filters by it. (The session's server may
        # hold other runs of these deployments: test_multinode.py's, in one process.)
        [run] = [r for r in flow_runs(client, deployment) if "e2e" in r.tags]
        assert says in flow_run_logs(client, run.id)
    # A later training iteration continues from the ledger, not from the rollback.
    run_deployment(
        stack,
        "rl-training/tiny-cpu",
        training(overrides=overrides(stack, finished_run, "e2e"), extra_iterations=1),
    )
    batch = store.read_rollouts(3)
    assert {s["weight_version"] for s in batch["samples"]} == {2}
    assert store.committed_versions()[-1] == 3


def test_a_bad_parameter_is_refused_before_any_flow_run(stack, client, finished_run):
    before = len(flow_runs(client, "gc-versions/gc-versions"))
    out = run_maintenance(
        stack, "gc-versions/gc-versions", check=False, run_name="e2e", keep_last=0
    )
    assert out.returncode != 0
    assert "less than the minimum of 1" in out.stdout + out.stderr
    assert len(flow_runs(client, "gc-versions/gc-versions")) == before


@pytest.mark.parametrize(
    "flow_name, params, message",
    [
        ("verify_engines_flow", {"run_name": "no-such-run"}, "no run 'no-such-run'"),
        ("reload_engines_flow", {"version": 99}, "version 99 of run 'e2e' is not committed"),
        ("publish_weights_flow", {"checkpoint": 99}, "checkpoint 99 of run 'e2e' is not committed"),
    ],
)
def test_bad_input_is_refused_before_the_lease(
    prefect_api, finished_run, flow_name, params, message
):
    # In this process (the maintenance deployments above ran the same flows in the
    # worker): the refusal comes before the lease, Ray or any engine is touched.
    from flows import maintenance_flows

    store = store_of(finished_run, "e2e")
    before = store.read_lease()
    flow = getattr(maintenance_flows, flow_name)
    state = flow(
        **{"run_name": "e2e", "storage_root": str(finished_run), **params}, return_state=True
    )
    assert state.is_failed()
    assert message in state.message
    assert store.read_lease() == before  # never taken
