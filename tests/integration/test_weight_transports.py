"""The in-memory weight transports end to end through the Prefect flow, with 2
engines of 2 ranks each (tensor: from 2 train ranks, one handle per engine rank
gathered over gloo; distributed: a broadcast group with every engine rank).
Versions pushed straight from the trainer (also ones never published) are
verified like disk versions. The run joins the session's cluster by address, so
its engines stay up after the flow (as on a persistent cluster): a new trainer
pushes into them, bitwise equal to a disk reload of the same version, and a
restarted engine takes a push again (distributed: through a rebuilt group).
(Each engine start is two processes that import torch: reusing the flow's
engines spares four per case.)"""

from __future__ import annotations

import pytest
import ray

from flows.config import load_config
from tasks import steps
from tasks.context import RunContext
from tasks.engines import engine_weights, push_engine_serves
from tasks.prepare import prepare_run

CONFIG = "configs/tiny-cpu.yaml"


def _overrides(tmp_path, transport: str) -> dict:
    return {
        # The session's cluster by address: the flow leaves its engines up at the end.
        "ray.address": ray.get_runtime_context().gcs_address,
        "run.name": f"wt-{transport}",
        "run.iterations": 3,
        "run.save_interval": 1,
        "storage.root": str(tmp_path / "runs"),
        "rollout.batch_size": 4,
        "rollout.n_samples_per_prompt": 4,
        "engines.num_engines": 2,
        "engines.tp_size": 2,
        "engines.num_cpus_per_engine": 0.25,
        "train.num_workers": 2 if transport == "tensor" else 1,
        "train.num_cpus_per_worker": 0.5,
        "weights.transport": transport,
        "weights.publish_interval": 2,  # v1 is pushed but never published
        "weights.flush_cache_interval": 2,
        "weights.bucket_bytes": 64 * 1024,  # several buckets for the tiny model
        "tasks.retry_delay_s": [0.1],
    }


def _sha(group, e: int) -> str:
    return ray.get(group.handle(e).state_sha256.remote())


@pytest.mark.parametrize("transport", ["tensor", "distributed"])
def test_in_memory_transport_through_the_flow(ray_cluster, prefect_api, tmp_path, transport):
    from flows.rl_training import rl_training

    overrides = _overrides(tmp_path, transport)
    cfg = load_config(CONFIG, overrides)
    try:
        state = rl_training(config_path=CONFIG, overrides=overrides, return_state=True)
        assert state.is_completed(), state
        assert state.result()["iterations"] == [1, 2, 3]
        _check_pushes(prepare_run(cfg))
    finally:  # the engines the flow left up, also when it failed
        RunContext(cfg=cfg, base_model_path="").engines().shutdown()


def _check_pushes(ctx) -> None:
    store = ctx.store
    assert store.committed_versions() == [0, 2, 3]  # the durable publish still runs
    for k in (1, 2, 3):  # rollout 2 used v1, which only ever existed in memory
        assert {s["weight_version"] for s in store.read_rollouts(k)["samples"]} == {k - 1}
        for e in (0, 1):  # pushed as version k (the iteration commits after verify passed)
            assert store.read_record(k, f"reload-e{e}")["result"]["version"] == k
        assert store.read_record(k, "iteration") is not None

    # The flow ended: its trainer is gone, its engines serve v3. A new trainer
    # restores state 3 and pushes it into each engine (distributed: a new group).
    group, trainer = ctx.engines(), ctx.trainer()
    try:
        assert trainer.iteration() is None and set(group.handles()) == {0, 1}
        trainer.ensure_state(3, ctx.base_model_path)
        for e in (0, 1):
            push_engine_serves(ctx, group, e, 3, force=True)
            assert steps.verify_engine(ctx, 3, e)["verified"]
        pushed = {_sha(group, e) for e in (0, 1)}
        assert len(pushed) == 1

        # A disk reload of the same version gives the same bytes.
        reply = ray.get(
            group.handle(0).update_weights_from_disk.remote(
                engine_weights(ctx, group, 0, 3).path, "3"
            )
        )
        assert reply["success"]
        assert {_sha(group, 0)} == pushed

        # An engine killed under a live trainer comes back and takes a push
        # again (distributed: the trainer rebuilds its group).
        ray.kill(group.handle(1), no_restart=True)
        push_engine_serves(ctx, group, 1, 3, force=True)
        assert steps.verify_engine(ctx, 3, 1)["verified"]
        assert {_sha(group, 1)} == pushed
    finally:
        trainer.shutdown()
        store.release_lease(ctx.owner)
