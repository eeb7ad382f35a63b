"""The whole tiny run with ``storage.root: s3://...`` on a real HTTP S3 endpoint
(moto's server): versions published to S3, pulled and verified into each
engine's local cache, reloaded, and verified."""

from __future__ import annotations

import pytest

from flows.config import ConfigError, load_config
from flows.driver import run_plain
from storage import verify_dir
from tests.s3_server import make_bucket, moto_s3


@pytest.fixture(scope="module")
def s3_url():
    with moto_s3() as url:
        make_bucket(url, "rl-runs")
        yield url


@pytest.mark.parametrize("delta", ["off", "on"])
def test_tiny_run_on_s3(ray_cluster, s3_url, tmp_path, delta):
    cache = tmp_path / "engine-cache"
    cfg = load_config(
        None,
        {
            "run.name": f"s3run-{delta}",
            "weights.delta": delta,
            "weights.base_cache_dir": str(tmp_path / "publisher-cache"),
            "run.iterations": 2,
            "run.save_interval": 2,
            "storage.root": "s3://rl-runs/exp",
            "storage.s3.endpoint_url": s3_url,
            "weights.transport": "object-store",
            "engines.local_cache_dir": str(cache),
            "engines.num_cpus_per_engine": 0.5,
            "train.num_cpus_per_worker": 0.5,
            "rollout.batch_size": 4,
            "rollout.n_samples_per_prompt": 4,
        },
    )
    ctx, rows, _ = run_plain(cfg, quiet=True)
    store = ctx.store
    run = f"s3run-{delta}"
    assert store.url == f"s3://rl-runs/exp/{run}"
    assert [r["iteration"] for r in rows] == [1, 2]
    assert store.committed_versions() == [0, 1, 2]
    assert store.committed_checkpoints() == [2]
    assert store.serving_versions() == {0: 2}
    # engines loaded pulled, verified copies from their local cache
    pulled = sorted(p.name for p in (cache / run / "weights").iterdir() if p.is_dir())
    assert {"v000001", "v000002"} <= set(pulled)
    for name in ("config.json", "manifest.json"):
        assert (cache / run / "weights" / "v000002" / name).is_file()
    if delta == "on":  # v1 and v2 are stored as deltas of v0; engines got them rebuilt
        for v in (1, 2):
            m = store.read_manifest(v)
            assert m.delta is not None and m.delta.base == 0
            assert m.total_bytes() < m.rebuilt().total_bytes()
            assert verify_dir(str(cache / run / "weights" / f"v{v:06d}")) == m.rebuilt()
    # credentials never reach run.json
    assert "AKIA" not in str(store.read_run_json())


def test_transport_and_root_must_agree():
    with pytest.raises(ConfigError, match="needs a local storage.root"):
        load_config(None, {"storage.root": "s3://b/p"})
    with pytest.raises(ConfigError, match="needs an object-store storage.root"):
        load_config(None, {"weights.transport": "object-store"})
