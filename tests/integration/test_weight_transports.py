"""The in-memory weight transports end to end through the plain driver, with 2
engines: versions pushed straight from the trainer (also ones never published),
verified like disk versions, bitwise equal to a disk reload of the same
version, and a restarted engine brought back (distributed: its group rebuilt)."""

from __future__ import annotations

import pytest
import ray

from flows.config import load_config
from flows.driver import run_plain
from tasks import steps
from tasks.engines import push_engine_serves, version_path


def _cfg(tmp_path, transport: str):
    return load_config(
        None,
        {
            "run.name": f"wt-{transport}",
            "run.iterations": 3,
            "run.save_interval": 1,
            "storage.root": str(tmp_path / "runs"),
            "rollout.batch_size": 4,
            "rollout.n_samples_per_prompt": 4,
            "engines.num_engines": 2,
            "engines.num_cpus_per_engine": 0.5,
            "train.num_cpus_per_worker": 0.5,
            "weights.transport": transport,
            "weights.publish_interval": 2,  # v1 is pushed but never published
            "weights.flush_cache_interval": 2,
            "weights.bucket_bytes": 64 * 1024,  # several buckets for the tiny model
            "tasks.retry_delay_s": [0.1],
        },
    )


def _sha(group, e: int) -> str:
    return ray.get(group.handle(e).state_sha256.remote())


@pytest.mark.parametrize("transport", ["tensor", "distributed"])
def test_in_memory_transport_end_to_end(ray_cluster, tmp_path, transport):
    ctx, rows, _ = run_plain(_cfg(tmp_path, transport), quiet=True, keep_actors=True)
    group = ctx.engines()
    try:
        store = ctx.store
        assert [r["iteration"] for r in rows] == [1, 2, 3]
        assert store.committed_versions() == [0, 2, 3]  # durable publish still runs
        for k in (1, 2, 3):  # rollout 2 used v1, which only ever existed in memory
            assert {s["weight_version"] for s in store.read_rollouts(k)["samples"]} == {k - 1}
        for e in (0, 1):
            assert steps.verify_engine(ctx, 3, e)["verified"]
        pushed = {_sha(group, e) for e in (0, 1)}
        assert len(pushed) == 1

        # A disk reload of the same version gives the same bytes.
        reply = ray.get(group.handle(0).update_weights_from_disk.remote(version_path(ctx, 3), "3"))
        assert reply["success"]
        assert {_sha(group, 0)} == pushed

        # A restarted engine comes back on disk v3, then takes a push again
        # (distributed: through a rebuilt group).
        ray.kill(group.handle(1), no_restart=True)
        push_engine_serves(ctx, group, 1, 3, force=True)
        assert steps.verify_engine(ctx, 3, 1)["verified"]
        assert {_sha(group, 1)} == pushed
    finally:
        ctx.trainer().shutdown()
        group.shutdown()
