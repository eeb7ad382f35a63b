"""The in-memory weight transports end to end through the Prefect flow, with 2
engines of 2 ranks each and 2 train ranks, in one run: iterations 1-3 with
``tensor`` (one handle per engine rank, gathered to train rank 0 over gloo),
then the run continued to 6 with ``distributed`` (a broadcast group with every
engine rank). For each transport: versions pushed straight from the trainer
(also ones never published) are verified like disk versions; after the flow a
new trainer pushes into the engines it left up, bitwise equal to a disk reload
of the same version, and a restarted engine takes a push again (distributed:
through a rebuilt group).

The run joins the session's cluster by address, so a flow leaves its engines up
(as on a persistent cluster) and the next flow reuses them, with the trainer the
checks left holding its last state: every engine start is two processes that
import torch."""

from __future__ import annotations

import ray

from flows.config import load_config
from tasks import lease as run_lease
from tasks import steps
from tasks.context import RunContext
from tasks.prepare import prepare_run
from tasks.serving.transports import engine_weights, push_engine_serves

CONFIG = "configs/tiny-cpu.yaml"
# Each transport's iterations, and the versions committed after them: the durable
# publish still runs, every publish_interval and at the end (v1 and v5 never are).
SEGMENTS = {"tensor": ((1, 2, 3), [0, 2, 3]), "distributed": ((4, 5, 6), [0, 2, 3, 4, 6])}


def _overrides(tmp_path, transport: str) -> dict:
    return {
        # The session's cluster by address: the flow leaves its engines up at the end.
        "ray.address": ray.get_runtime_context().gcs_address,
        "run.name": "wt",
        "run.iterations": SEGMENTS[transport][0][-1],
        "run.save_interval": 1,
        "storage.root": str(tmp_path / "runs"),
        "rollout.batch_size": 4,
        "rollout.n_samples_per_prompt": 4,
        "engines.num_engines": 2,
        "engines.tp_size": 2,
        "engines.num_cpus_per_engine": 0.25,
        "train.num_workers": 2,
        "train.num_cpus_per_worker": 0.5,
        "weights.transport": transport,
        "weights.publish_interval": 2,
        "weights.flush_cache_interval": 2,
        "weights.bucket_bytes": 64 * 1024,  # several buckets for the tiny model
        "tasks.retry_delay_s": [0.1],
    }


def _sha(group, e: int) -> str:
    return ray.get(group.handle(e).state_sha256.remote())


def test_in_memory_transports_through_the_flow(ray_cluster, prefect_api, tmp_path):
    from flows.rl_training import rl_training

    cfg = load_config(CONFIG, _overrides(tmp_path, "tensor"))
    try:
        for transport, (ks, versions) in SEGMENTS.items():
            overrides = _overrides(tmp_path, transport)
            state = rl_training(config_path=CONFIG, overrides=overrides, return_state=True)
            assert state.is_completed(), (transport, state)
            assert state.result()["iterations"] == list(ks)
            _check_pushes(prepare_run(load_config(CONFIG, overrides)), ks, versions)
    finally:  # the engines the flows left up, and the last checks' trainer, also on a failure
        ctx = RunContext(cfg=cfg, base_model_path="")
        ctx.trainer().shutdown()
        ctx.engines().shutdown()


def _check_pushes(ctx, ks: tuple[int, ...], versions: list[int]) -> None:
    """The run's records up to ks[-1], then pushes of state ks[-1] by a new trainer,
    which is left up holding it (the next flow continues with it)."""
    store, last = ctx.store, ks[-1]
    assert store.committed_versions() == versions
    for k in ks:  # rollout 2 (6) used v1 (v5), which only ever existed in memory
        assert {s["weight_version"] for s in store.read_rollouts(k)["samples"]} == {k - 1}
        for e in (0, 1):  # pushed as version k (the iteration commits after verify passed)
            assert store.read_record(k, f"reload-e{e}")["result"]["version"] == k
        assert store.read_record(k, "iteration") is not None

    # The flow ended: its trainer is gone, its engines serve the last version. A new
    # trainer restores that state and pushes it into each engine (distributed: a new group).
    group, trainer = ctx.engines(), ctx.trainer()
    try:
        assert trainer.iteration() is None and set(group.handles()) == {0, 1}
        trainer.ensure_state(last, ctx.base_model_path)
        for e in (0, 1):
            push_engine_serves(ctx, group, e, last, force=True)
            assert steps.verify_engine(ctx, last, e)["verified"]
        pushed = {_sha(group, e) for e in (0, 1)}
        assert len(pushed) == 1

        # A disk reload of the same version gives the same bytes.
        path = engine_weights(ctx, group, 0, last).path
        assert ray.get(group.handle(0).update_weights_from_disk.remote(path, str(last)))["success"]
        assert {_sha(group, 0)} == pushed

        # An engine killed under a live trainer comes back and takes a push
        # again (distributed: the trainer rebuilds its group).
        ray.kill(group.handle(1), no_restart=True)
        push_engine_serves(ctx, group, 1, last, force=True)
        assert steps.verify_engine(ctx, last, 1)["verified"]
        assert {_sha(group, 1)} == pushed
    finally:
        run_lease.release(ctx)  # renewals stopped first, then released
