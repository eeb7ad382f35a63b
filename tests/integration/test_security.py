"""Security and integrity of the orchestration: the run's own Ray cluster
listens on loopback only, the CLI refuses a bad config before any flow run or
run state exists, a published version is never silently replaced by an older
one, and warnings of a step reach its task run's log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from flows.cli import main
from flows.driver import run_plain
from tasks import lease as run_lease
from tasks.serving.versions import expected_version
from tests.integration.test_run import tiny_cfg

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh process: start the run's local cluster the way prepare_run
# does, then list the TCP sockets that this process and its children listen on.
LISTENERS = r"""
import json, os, ray
from flows.config import load_config
from tasks.prepare import connect_ray

connect_ray(load_config(None, {"ray.num_cpus": 2}))
ray.get(ray.remote(lambda: 1).remote())  # a worker process too

def children(pid):
    out = {pid}
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) in out:
                out |= children(int(p))
        except OSError:
            pass
    return out

inodes = {}
for pid in children(os.getpid()):
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes[link[8:-1]] = pid
    except OSError:
        pass

def addr(hex_ip, v6):
    import ipaddress
    raw = bytes.fromhex(hex_ip)
    if not v6:
        return str(ipaddress.IPv4Address(raw[::-1]))
    return str(ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))))

found = []
for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
    for line in open(table).read().splitlines()[1:]:
        cols = line.split()
        if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
            ip, port = cols[1].split(":")
            found.append([addr(ip, v6), int(port, 16), open(f"/proc/{inodes[cols[9]]}/comm").read().strip()])
print("LISTENERS " + json.dumps({"gcs": ray.get_runtime_context().gcs_address, "sockets": found}))
"""


def is_loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


@pytest.mark.skipif(
    not Path("/proc/net/tcp").exists(), reason="reads listening sockets from /proc (Linux)"
)
def test_the_runs_local_ray_cluster_listens_on_loopback_only():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", LISTENERS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.split("LISTENERS ", 1)[1])
    gcs_port = int(report["gcs"].rsplit(":", 1)[1])
    sockets = report["sockets"]
    assert gcs_port in {port for _, port, _ in sockets}, sockets  # the GCS itself was seen
    exposed = [s for s in sockets if not is_loopback(s[0])]
    assert exposed == [], f"Ray servers listening beyond loopback: {exposed}"


def flow_run_count(run: str) -> int:
    """Flow runs of ``run`` (the session's server holds other tests' runs too)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        named = FlowRunFilter(name=FlowRunFilterName(like_=f"{run}:"))
        return len(client.read_flow_runs(flow_run_filter=named))


def test_cli_refuses_credentials_in_the_root_before_any_flow_run(prefect_api, tmp_path, capsys):
    before = flow_run_count("tiny-cpu")
    code = main(
        [
            "run",
            "configs/tiny-cpu.yaml",
            "--set",
            "storage.root=s3://AKIAEXAMPLEKEY:verysecret0123@bucket/prefix",
            "--set",
            "weights.transport=object-store",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "contains credentials" in err
    assert "verysecret0123" not in err and "AKIAEXAMPLEKEY" not in err
    assert flow_run_count("tiny-cpu") == before  # nothing of it reached the Prefect database


def test_cli_disables_ray_auth_only_for_its_own_local_cluster(tmp_path, monkeypatch, capsys):
    # A config refused after load (model.path is no checkpoint) stops before Ray starts.
    missing = ["--set", f"model.path={tmp_path / 'no-model'}", "--set", f"storage.root={tmp_path}"]
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert (
        main(["run", "configs/tiny-cpu.yaml", "--set", "ray.address=10.0.0.1:6379", *missing]) == 2
    )
    assert "RAY_AUTH_MODE" not in os.environ  # a remote cluster keeps the user's token auth
    assert main(["run", "configs/tiny-cpu.yaml", *missing]) == 2
    assert os.environ["RAY_AUTH_MODE"] == "disabled"  # the loopback-only local cluster
    assert "not a local HF checkpoint" in capsys.readouterr().err


def test_a_refused_reward_leaves_no_run_state_and_a_trusted_one_scores_the_rollouts(
    ray_cluster, tmp_path, capsys, monkeypatch
):
    """A typo in rollout.reward is refused before any run state; the fix runs with the
    config file's reward from a trusted module, which scores every sample. One run for
    both: each run is an engine and a train rank, processes importing torch."""
    import yaml

    pkg = tmp_path / "pkgs" / "flatrewards"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "flat.py").write_text(
        "def quarter(response: str, label: str) -> float:\n    return 0.25\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    root = tmp_path / "runs"
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "trusted", "iterations": 1},
                "storage": {"root": str(root)},
                "rollout": {
                    "reward": "flatrewards.flat:quarter",
                    "trusted_reward_modules": ["flatrewards"],
                    "batch_size": 4,
                    "n_samples_per_prompt": 4,
                },
                "engines": {"num_cpus_per_engine": 0.5},
                "train": {"num_cpus_per_worker": 0.5},
            }
        )
    )
    common = ["run", str(path), "--plain"]
    assert main([*common, "--set", "rollout.reward=mtach"]) == 2
    assert "'mtach' is not a builtin" in capsys.readouterr().err
    assert not (root / "trusted").exists()  # no run.json, lease or v0 to freeze the typo
    assert main(common) == 0
    run_json = json.loads((root / "trusted" / "run.json").read_text())
    assert run_json["config"]["rollout"]["reward"] == "flatrewards.flat:quarter"
    from storage.config import StorageConfig
    from storage.run_store import RunStore

    store = RunStore(StorageConfig(root=str(root)), "trusted")
    assert {s["reward"] for s in store.read_rollouts(1)["samples"]} == {0.25}


def test_a_published_version_with_its_manifest_gone_is_republished_not_replaced(
    ray_cluster, tmp_path
):
    cfg = tiny_cfg(tmp_path, "gone")
    # The engine stays up for the continued run (an engine start is a process importing
    # torch); the trainer goes, so v2 is rebuilt from checkpoint 2.
    ctx, _, _ = run_plain(cfg, quiet=True, keep_actors=True)
    ctx.trainer().shutdown()
    store = ctx.store
    files = store.read_manifest(2).file_set()
    os.remove(Path(store.local_version_dir(2)) / "manifest.json")
    ctx3, rows, _ = run_plain(tiny_cfg(tmp_path, "gone", **{"run.iterations": 3}), quiet=True)
    assert [r["iteration"] for r in rows] == [3]
    # Rollout 3 was generated by v2 (not by v1, the newest version left intact) ...
    assert {s["weight_version"] for s in store.read_rollouts(3)["samples"]} == {2}
    # ... which was republished from trainer state 2, byte for byte.
    assert store.read_manifest(2).file_set() == files
    assert store.committed_versions() == [0, 1, 2, 3]
    # A shard of the newest version cut short under a manifest that still reads: the
    # continued run discards v3 and republishes it from checkpoint 3, byte for byte.
    files3 = store.read_manifest(3).file_set()
    shard = next(Path(store.local_version_dir(3)).glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert store.version_state(3) == "damaged" and 3 in store.committed_checkpoints()
    try:
        assert expected_version(ctx3, 4) == 3
    finally:  # the trainer that rebuilt state 3 (left up, it idled to the session's end)
        ctx3.trainer().shutdown()
    assert store.read_manifest(3).file_set() == files3
    assert store.verify_version(3).version == 3


def test_step_warnings_reach_the_task_run_log(prefect_api, tmp_path):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterLevel
    from prefect.logging.handlers import APILogHandler

    from flows.step_tasks import TASKS
    from tasks.context import RunContext

    # A fresh run name: Prefect's result cache (keyed {run}/{k}/{step}) outlives the session.
    name = f"warned-{uuid.uuid4().hex[:8]}"
    cfg = tiny_cfg(tmp_path, name)
    ctx = RunContext(cfg=cfg, base_model_path=str(tmp_path))
    # The train step of iteration 1 is committed with the warning its restore gave.
    warning = f"checkpoint 1 of run {name!r} is corrupt (sha256 mismatch); trying an older one"
    ctx.store.write_record(
        1,
        "train",
        {
            "run": name,
            "iteration": 1,
            "step": "train",
            "result": {"loss": 0.5, "warnings": [warning]},
        },
    )

    @flow(name="warned-steps")
    def run_train() -> str:
        from prefect.runtime import flow_run

        TASKS["train"](ctx, 1)
        return flow_run.id

    flow_run_id = run_train()
    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            LogFilter(
                flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]), level=LogFilterLevel(ge_=30)
            )
        )
    assert [(log.level, log.message) for log in logs if log.task_run_id] == [
        (30, f"train: {warning}")
    ]


def test_a_run_whose_lease_was_taken_over_stops_writing(ray_cluster, tmp_path):
    from storage.errors import LeaseLostError
    from storage.run_store import RunStore
    from tasks.lease import LeaseKeeper
    from tasks.prepare import prepare_run

    cfg = tiny_cfg(tmp_path, "fenced")
    ctx = prepare_run(cfg)
    assert ctx.fence is not None and ctx.store.fence == ctx.fence
    with LeaseKeeper(ctx) as keeper:
        other = RunStore(cfg.storage, "fenced")
        taken = other.acquire_lease("other-host:1", cfg.storage.lease_ttl_s, force=True)
        assert taken.fence > ctx.fence
        # Every commit of the old writer is refused, from any store rebuilt from its context ...
        with pytest.raises(LeaseLostError):
            ctx.store.write_record(1, "rollout", {"result": {}})
        # ... also the train ranks' checkpoint and weights commits (they get the fence per call).
        trainer = ctx.trainer()
        try:
            trainer.ensure_state(0, ctx.base_model_path)
            with pytest.raises(LeaseLostError):
                trainer.save(0)
            with pytest.raises(LeaseLostError):
                trainer.export_hf(1, 1, 0)
        finally:
            trainer.shutdown()
        assert ctx.store.committed_checkpoints() == [] and 1 not in ctx.store.committed_versions()
        # ... and its keeper stops the run before another iteration.
        keeper.renew()
        with pytest.raises(LeaseLostError, match="lease was taken over"):
            keeper.check()
    assert other.read_lease().owner == "other-host:1"  # the new holder's lease is left alone
    assert ctx.store.read_record(1, "rollout") is None


def test_a_checkpoint_fallback_warning_is_part_of_the_step_result(ray_cluster, tmp_path):
    cfg = tiny_cfg(tmp_path, "fallback", **{"run.iterations": 1})
    # Checkpoint 1 committed; the trainer is shut down, the engine kept for the next run.
    ctx, _, _ = run_plain(cfg, quiet=True, keep_actors=True)
    ctx.trainer().shutdown()
    ckpt = Path(ctx.store.checkpoint_url(1))
    biggest = max((p for p in ckpt.iterdir() if p.name != "COMMIT"), key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    biggest.write_bytes(bytes(data))
    _, rows, _ = run_plain(tiny_cfg(tmp_path, "fallback"), quiet=True)
    assert [r["iteration"] for r in rows] == [2]
    # train[k=2] rebuilt state 1 from the base weights; its result (what the
    # Prefect task logs as warnings in the task run's log) says why.
    warned = ctx.store.read_record(2, "train")["result"].get("warnings") or []
    assert any("checkpoint 1" in w and "corrupt" in w for w in warned), warned


def test_a_maintenance_flow_refuses_a_live_holder_at_once(ray_cluster, tmp_path):
    # The operator asks reload-engines while another writer holds the run: the answer is
    # a refusal naming the holder now, not after watching its renewals for a whole TTL.
    from flows.maintenance_flows import RunRef, open_run, writing
    from storage.errors import LeaseHeldError
    from tasks.prepare import check_run, prepare_run

    cfg = tiny_cfg(tmp_path, "held", **{"storage.lease_ttl_s": 30})
    check_run(cfg)
    ctx = prepare_run(cfg)
    run_lease.release(ctx)  # renewals stopped first, then released
    ctx.store.acquire_lease("other-host:1", 30)
    ref = RunRef(run_name="held", storage_root=cfg.storage.root)
    with pytest.raises(LeaseHeldError, match="other-host:1"):
        with writing(open_run(ref)):
            pass
    # Waiting would have ended in a takeover (the holder never renews); refusing leaves it.
    assert ctx.store.read_lease().owner == "other-host:1"
