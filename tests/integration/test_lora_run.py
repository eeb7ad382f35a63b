"""A tiny LoRA run end to end on real Ray actors (plain driver): every version after v0
is an adapter of v0, published, pushed to the embedded engines as tensors or loaded
from S3 (moto's server, pulled and verified into the engines' cache), and verified;
a run resumed from its checkpoint on S3 ends with the same adapter bytes as one that
ran through on the tensor transport; an engine restarted mid-run loads v0, then the
newest adapter. (The disk transport's load is the S3 path's last half: the verified
local folder.)"""

from __future__ import annotations

import pytest
import ray

from flows.config import load_config
from flows.driver import run_plain
from storage.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from tasks import steps
from tests.s3_server import make_bucket, moto_s3


@pytest.fixture(scope="module")
def s3_url():
    with moto_s3() as url:
        make_bucket(url, "lora-runs")
        yield url


def lora_cfg(tmp_path, name: str, iterations: int, **extra):
    overrides = {
        "run.name": name,
        "run.iterations": iterations,
        "storage.root": str(tmp_path / "runs"),
        "train.lora.rank": 8,
        "rollout.batch_size": 4,
        "rollout.n_samples_per_prompt": 4,
        "engines.num_cpus_per_engine": 0.5,
        "train.num_cpus_per_worker": 0.5,
        "tasks.retry_delay_s": [0.1],
    }
    overrides.update(extra)
    return load_config(None, overrides)


def adapter_bytes(store, v: int) -> dict[str, str]:
    m = store.read_manifest(v)
    return {f.name: f.sha256 for f in m.files}


@pytest.fixture(scope="module")
def through(ray_cluster, tmp_path_factory):
    """Three iterations pushed as tensors, uninterrupted: the reference."""
    tmp = tmp_path_factory.mktemp("lora-tensor")
    ctx, rows, _ = run_plain(
        lora_cfg(tmp, "lora", 3, **{"weights.transport": "tensor"}), quiet=True
    )
    return ctx.store, rows


def test_a_lora_run_publishes_adapters_of_v0_and_engines_serve_them(through):
    store, rows = through
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert store.committed_versions() == [0, 1, 2, 3]
    base = store.read_manifest(0)
    assert base.adapter is None
    for v in (1, 2, 3):
        m = store.read_manifest(v)
        assert m.adapter is not None and m.adapter.base_digest == base.digest()
        assert set(adapter_bytes(store, v)) == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    # every sample of rollout k came from adapter version k-1, and verify saw each served
    for k in (1, 2, 3):
        assert {s["weight_version"] for s in store.read_rollouts(k)["samples"]} == {k - 1}
        assert store.read_record(k, "verify-e0")["result"]["served"] == str(k)
    assert store.serving_versions() == {0: 3}
    # each sync moved the adapter (pushed as tensors), a small part of the model's bytes
    model_bytes = base.total_bytes()
    assert all(0 < r["sync_bytes"] < model_bytes / 3 for r in rows), [r["sync_bytes"] for r in rows]


def test_a_lora_run_resumed_on_s3_ends_with_the_adapters_of_one_that_ran_through(
    ray_cluster, tmp_path, s3_url, through
):
    extra = {
        "weights.transport": "object-store",
        "storage.root": "s3://lora-runs/exp",
        "storage.s3.endpoint_url": s3_url,
        "engines.local_cache_dir": str(tmp_path / "engine-cache"),
    }
    # The engine stays up for the resumed run (an engine start is a process importing
    # torch); the trainer goes, so the resumed run restores it from S3.
    first, _, _ = run_plain(lora_cfg(tmp_path, "lora", 2, **extra), quiet=True, keep_actors=True)
    first.trainer().shutdown()
    assert first.store.committed_versions() == [0, 1, 2]
    ctx, rows, _ = run_plain(lora_cfg(tmp_path, "lora", 3, **extra), quiet=True, keep_actors=True)
    try:
        assert [r["iteration"] for r in rows] == [3]
        reference, _ = through
        for v in (1, 2, 3):
            assert adapter_bytes(ctx.store, v) == adapter_bytes(reference, v)
        # engines loaded verified pulls of v0 and the adapter
        cached = tmp_path / "engine-cache" / "lora" / "weights"
        assert (cached / "v000003" / ADAPTER_WEIGHTS).is_file()
        assert (cached / "v000000" / "config.json").is_file()
        # an engine that dies is restarted on v0, then given the newest adapter
        group = ctx.engines()
        ray.kill(group.handle(0), no_restart=True)
        assert steps.verify_engine(ctx, 3, 0)["verified"]
        info = ray.get(group.handle(0).model_info.remote())
        assert (info["weight_version"], info["lora_name"]) == ("3", "v3")
    finally:
        ctx.trainer().shutdown()
        ctx.engines().shutdown()
