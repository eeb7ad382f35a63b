"""Past one machine: runs on a multi-node Ray cluster (a head and worker nodes,
each a real raylet; ``tests/e2e/ray_nodes.py``), driven by Prefect deployments
on a process worker that joins it by ``ray.address``.

"GPU host A" offers ``engine_host``, "GPU host B" offers ``train_host``;
``engines.node_resource`` / ``train.node_resource`` pin each side there. Every
host has its own cache folder (a private mount at one path, as separate disks),
and host B its own copy of one local root. One object-store run (moto S3)
carries the fault-matrix row for a lost host: host A, with both engines, dies
after train[2] and a replacement host joins; the run heals (the engines'
placement groups move, they pull into the new host's cache and restart) and
ends byte-identical to a single-node run. The engines it leaves serve the
reload-engines and verify-engines deployments. Then a ``distributed`` (gloo)
run across hosts; refused, each naming its host: a side pinned to the lost host
alone, and a ``disk`` run on a root host B does not share. Few runs, small
ones: the module is a handful of runs on a 2-core machine.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from flows.config import load_config
from tests.e2e.fault_matrix import BASE, final_weights
from tests.e2e.fault_matrix import overrides as fault_overrides
from tests.e2e.ray_nodes import RayNodes, can_isolate
from tests.e2e.services import ROOT, rl_run_args, worker_stack

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not can_isolate(), reason="needs mount namespaces (unshare -m)"),
]

ITERATIONS = 2
ENGINES = 2  # 0.5 CPU each: both on host A (1 CPU), so they share its cache
BUCKET = "multinode"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("multinode")


@pytest.fixture(scope="module")
def cluster(work):
    """Host B (trainer) is the head; host A (engines) joins it."""
    host_b = {work / "cache": work / "host-b" / "cache", work / "local": work / "host-b" / "local"}
    nodes = RayNodes(work, 1, {"train_host": 1}, host_b)
    try:
        own = {"engine_host": 1, "host_a": 1}  # host_a: a side pinned to this host alone
        nodes.add("host-a", 1, own, {work / "cache": work / "host-a" / "cache"})
        yield nodes
    finally:
        nodes.close()


@pytest.fixture(scope="module")
def s3():
    from tests.s3_server import make_bucket, moto_s3

    with moto_s3() as url:
        make_bucket(url, BUCKET)
        yield url


@pytest.fixture(scope="module")
def stack(cluster, prefect_server, work):
    (work / "stack").mkdir()
    with worker_stack(work / "stack", cluster.address, prefect_server) as s:
        yield s


def pinned(cluster, work: Path, name: str, **extra) -> dict:
    """The fault matrix's run settings, pinned to the hosts, on the test cluster."""
    return {
        **fault_overrides(work / "runs", name),
        "run.iterations": ITERATIONS,
        "engines.num_engines": ENGINES,
        "engines.node_resource": "engine_host",
        "train.node_resource": "train_host",
        "ray.address": cluster.address,
        "tasks.timeout_s": 300,
        # A lost host's engines wait for their placement group to move to a new host.
        "engines.health_timeout_s": 90,
        **extra,
    }


def on_s3(s3: str, work: Path) -> dict:
    return {
        "storage.root": f"s3://{BUCKET}/runs",
        "storage.s3.endpoint_url": s3,
        "weights.transport": "object-store",
        "engines.local_cache_dir": str(work / "cache"),
    }


def deploy(stack, name: str, check: bool = True, **params):
    """``prefect deployment run NAME --param k=v ... --watch`` on the stack's worker."""
    flags = [a for k, v in params.items() for a in ("--param", f"{k}={json.dumps(v)}")]
    args = ["deployment", "run", name, *flags, "--watch", "--watch-timeout", "900"]
    return stack.cli(*args, timeout=1000, check=check)


def flow_run_of(stack, deployment: str, tag: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    named = DeploymentFilter(name=DeploymentFilterName(any_=[deployment.split("/")[1]]))
    with temporary_settings({PREFECT_API_URL: stack.api_url}):
        with get_client(sync_client=True) as client:
            runs = [r for r in client.read_flow_runs(deployment_filter=named) if tag in r.tags]
    assert runs, f"no flow run of {deployment} tagged {tag}"
    return runs[0]


@pytest.fixture(scope="module")
def reference(matrix_versions) -> dict[str, str]:
    """The same run on one node, on disk, uninterrupted: the fault matrix's reference
    run (tests/e2e/fault_matrix.py, made once per pytest run) at version ITERATIONS.
    Neither its length nor its engine count changes a version's weights: each sample
    draws from its own seed (seed, k, prompt, j) on whichever engine decodes it."""
    return matrix_versions[ITERATIONS]


@pytest.fixture(scope="module")
def healed_run(cluster, stack, s3, work):
    """The object-store run through the deployment; host A is lost once train[2]
    commits, and a replacement host (an empty cache) joins."""
    from storage.run_store import RunStore

    over = {**pinned(cluster, work, "mn-s3"), **on_s3(s3, work)}
    store = RunStore(load_config(BASE, over).storage, "mn-s3")
    lost = threading.Event()

    def lose_host_a_after_train_2() -> None:
        deadline = time.monotonic() + 600
        # Each look is an S3 request to moto, which serves the run from this process
        # too: twice a second until iteration 1 commits (minutes: the engines' first
        # start), then every 0.1 s, as before: rollout[2] and train[2] take seconds
        # after it, and host A must die right after train[2], before v2 reaches it.
        for k, step, pause in ((1, "iteration", 0.5), (2, "train", 0.1)):
            while time.monotonic() < deadline and store.read_record(k, step) is None:
                time.sleep(pause)
        cluster.lose("host-a")
        lost.set()
        cache = {work / "cache": work / "host-a2" / "cache"}
        # 2 CPUs: room for the distributed run's engine beside these two
        cluster.add("host-a2", 2, {"engine_host": 1}, cache)

    watcher = threading.Thread(target=lose_host_a_after_train_2, daemon=True)
    watcher.start()
    deploy(stack, "rl-training/tiny-cpu", overrides=over)
    watcher.join(timeout=120)
    assert lost.is_set()
    return store


def pulls(store, k: int) -> list[dict]:
    out = []
    for e in range(ENGINES):
        record = store.read_record(k, f"reload-e{e}")
        assert record is not None, (k, e)
        out.append(record["result"]["pull"])
    return out


def test_lost_engine_host_heals_onto_a_replacement_byte_identical(healed_run, reference, work):
    """Fault matrix, lost host: the run completes, with the single-node run's weights."""
    assert healed_run.committed_versions() == list(range(ITERATIONS + 1))
    assert final_weights(healed_run, ITERATIONS) == reference
    # Both engines were restarted on the replacement host, from its own cache.
    (before,) = {p["node"] for p in pulls(healed_run, 1)}
    (after,) = {p["node"] for p in pulls(healed_run, 2)}
    assert before != after
    assert cached(work, "host-a") == {"v000000", "v000001"}
    assert cached(work, "host-a2") == {"v000002"}


def cached(work: Path, host: str) -> set[str]:
    return {p.name for p in (work / host / "cache").glob("*/weights/v*")}


def test_each_engine_host_pulls_once_into_its_own_cache(healed_run, work):
    for k in range(1, ITERATIONS + 1):
        # Both engines sit on one host: exactly one of them copied the version there.
        copies = [p["copied"] for p in pulls(healed_run, k)]
        assert len({p["node"] for p in pulls(healed_run, k)}) == 1 and copies.count(True) == 1
    # Pulls ran on the engine hosts, never in the flow process nor on the train host.
    assert not list((work / "cache").iterdir())
    assert not list((work / "host-b" / "cache").iterdir())


def test_deployments_act_on_the_engines_left_on_the_cluster(stack, s3, healed_run):
    ref = {"run_name": "mn-s3", "storage_root": f"s3://{BUCKET}/runs", "s3_endpoint_url": s3}
    deploy(stack, "reload-engines/reload-engines", **ref, version=1)
    assert healed_run.serving_versions() == {e: 1 for e in range(ENGINES)}
    deploy(stack, "verify-engines/verify-engines", **ref)
    run = flow_run_of(stack, "verify-engines/verify-engines", "mn-s3")
    assert run.state.is_completed(), run.state


def run_plain_cli(over: dict) -> subprocess.CompletedProcess:
    """``prefect-rl run --plain`` (no Prefect: these runs test the cluster, not the
    deployment, and a flow run process costs seconds on 2 cores)."""
    cli = [*rl_run_args(BASE, over), "--plain"]
    return subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_distributed_broadcast_across_hosts(cluster, healed_run, work):
    """Trainer rank 0 on host B broadcasts over gloo to an engine on an engine host."""
    from storage.run_store import RunStore

    extra = {"weights.transport": "distributed", "engines.num_engines": 1, "run.iterations": 1}
    over = pinned(cluster, work, "mn-dist", **extra)
    out = run_plain_cli(over)
    assert out.returncode == 0, out.stderr[-3000:]
    store = RunStore(load_config(BASE, over).storage, "mn-dist")
    assert store.read_record(1, "verify-e0")["result"]["served"] == "1"


def test_a_side_pinned_to_the_lost_host_alone_is_refused_naming_it(cluster, healed_run, work):
    (lost,) = {p["node"] for p in pulls(healed_run, 1)}  # host A, which died
    out = run_plain_cli(pinned(cluster, work, "mn-lost", **{"engines.node_resource": "host_a"}))
    assert out.returncode != 0
    assert f"lost node(s) {lost[:12]}" in out.stderr, out.stderr[-3000:]
    assert "no alive node offers resource 'host_a'" in out.stderr


def test_disk_transport_on_a_root_one_host_does_not_share_is_refused(cluster, work):
    out = run_plain_cli(pinned(cluster, work, "mn-disk", **{"storage.root": str(work / "local")}))
    assert out.returncode != 0
    assert "do not see it" in out.stderr and "offers train_host" in out.stderr, out.stderr[-3000:]
    assert "offers engine_host" not in out.stderr  # the engine host shares that folder
