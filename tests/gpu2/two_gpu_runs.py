"""What the 2-GPU tests share: the run configs, where each actor computes, and
the checks that every iteration was verified and that a pushed version is the
published one, byte for byte.

Where actors sit is read from the actors themselves (``__ray_call__``): the
UUID of the CUDA device the process computes on, so "different GPUs" means
different physical devices, whatever index Ray's ``CUDA_VISIBLE_DEVICES``
gives each process. Without CUDA (a Ray node told it has GPUs) it falls back
to the GPU ids Ray assigned.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import ray
import torch

# Why a test of this folder does not run; the command that runs it.
NEEDS_TWO = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs: run `bash scripts/gpu2.sh` on nvidia-h200-x2 (see its header)",
)

SHORT = {
    "run.iterations": 3,
    "rollout.batch_size": 4,
    "rollout.n_samples_per_prompt": 4,
    "weights.publish_interval": 2,  # v1 only ever exists in memory: serving it proves the push
    "tasks.retry_delay_s": [0.1],
}
COLOCATED = {
    "placement.colocate": True,
    "train.num_gpus_per_worker": 0.5,
    "engines.num_gpus_per_engine": 0.5,
    "train.num_cpus_per_worker": 0.5,
    "engines.num_cpus_per_engine": 0.5,
}
# Each run's own keys (plus SHORT, a run name and a storage root).
RUNS: dict[str, dict[str, Any]] = {
    # Trainer and engine a whole GPU each (two 1-GPU placement groups: Ray gives
    # them different devices); the broadcast group is NCCL across the two GPUs.
    "nccl-broadcast": {
        "train.num_gpus_per_worker": 1.0,
        "engines.num_gpus_per_engine": 1.0,
        "weights.transport": "distributed",
    },
    # One bundle per GPU: train rank j and engine rank j share GPU j. FSDP2 over
    # NCCL, the engine's all-reduces over NCCL, and each engine rank's CUDA IPC
    # handle made by the train rank on its own GPU (HandleGather: j % world).
    "fsdp2-tp2-engine": {
        **COLOCATED,
        "train.num_workers": 2,
        "engines.tp_size": 2,
        "weights.transport": "tensor",
    },
    # Two 1-rank engines, one per GPU, fed by two FSDP ranks. A 1-rank engine's
    # handle is made by train rank 0 (on GPU 0), so engine 1 (on GPU 1) opens a
    # handle of another device.
    "fsdp2-two-engines": {
        **COLOCATED,
        "train.num_workers": 2,
        "engines.num_engines": 2,
        "weights.transport": "tensor",
    },
    # megatron TP=2 over two GPUs (one train rank each), the engine beside rank 0.
    "megatron-tp2": {
        **COLOCATED,
        "run.iterations": 2,
        "run.save_interval": 1,  # a TP=2 checkpoint each iteration
        "weights.publish_interval": 1,
        "train.backend": "megatron",
        "train.num_workers": 2,
        "train.megatron.tensor_parallel": 2,
        "model.dtype": "bfloat16",
        "weights.transport": "tensor",
    },
}


def overrides(name: str, root: str) -> dict[str, Any]:
    """The ``--set`` overrides of run ``name`` with its storage under ``root``."""
    return {**SHORT, "run.name": f"gpu2-{name}", "storage.root": root, **RUNS[name]}


def _device_probe():
    """A function run inside an actor: which device its process computes on.
    Nested, so Ray ships it by value (the test modules are not importable there)."""

    def probe(_actor: Any) -> str:
        import ray
        import torch

        if torch.cuda.is_available():
            return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        return f"ray-gpu-{sorted(str(i) for i in ray.get_gpu_ids())}"

    return probe


def device_of(actor: Any) -> str:
    """The device of one actor (a train rank, or an engine's rank 0)."""
    return ray.get(actor.__ray_call__.remote(_device_probe()))


def engine_devices(engine: Any) -> list[str]:
    """The device of every rank of one engine, rank 0 first."""
    probe = _device_probe()

    def ranks(actor: Any) -> list[str]:
        import ray

        ranks = actor.served.ranks
        peers = [] if ranks is None else ranks.peers
        return [probe(actor), *ray.get([p.__ray_call__.remote(probe) for p in peers])]

    return ray.get(engine.__ray_call__.remote(ranks))


def broadcast_groups(trainer_rank0: Any, engine: Any) -> tuple[list[str], list[str]]:
    """Class names of the weight-broadcast groups each side holds (ProcessGroupNCCL
    on GPUs): trainer rank 0's, then the engine's rank 0's."""

    def sender(actor: Any) -> list[str]:
        return [type(pg).__name__ for pg in actor.pusher.broadcast.groups.values()]

    def receiver(actor: Any) -> list[str]:
        return [type(pg).__name__ for pg in actor.updates.groups.values()]

    return (
        ray.get(trainer_rank0.__ray_call__.remote(sender)),
        ray.get(engine.__ray_call__.remote(receiver)),
    )


def check_verified_every_iteration(ctx: Any, rows: list[dict[str, Any]], engines: int) -> None:
    """Every iteration of the run committed after verify passed on every engine for
    version k; rollout k was generated by version k-1 (in-memory transports push k);
    and the versions ``weights.publish_interval`` skipped, served all the same,
    never reached storage (they went from trainer to engine in memory)."""
    store, last = ctx.store, ctx.cfg.run.iterations
    assert [r["iteration"] for r in rows] == list(range(1, last + 1))
    for k in range(1, last + 1):
        assert store.read_record(k, "iteration") is not None, k
        assert {s["weight_version"] for s in store.read_rollouts(k)["samples"]} == {k - 1}, k
        for e in range(engines):
            verify = store.read_record(k, f"verify-e{e}")["result"]
            assert verify["verified"] and verify["version"] == k, (k, e, verify)
            assert verify["rollout_weight_version"] == k - 1, (k, e, verify)
            assert store.read_record(k, f"reload-e{e}")["result"]["version"] == k, (k, e)
    in_memory_only = {k for k in range(1, last) if k % ctx.cfg.weights.publish_interval}
    assert not in_memory_only & set(store.committed_versions())


def check_pushed_equals_published(ctx: Any, engine_id: int, version: int) -> str:
    """The bytes engine ``engine_id`` holds after the last push equal a disk reload
    of the same published version; returns their sha256."""
    from tasks import colocate
    from tasks.serving.transports import engine_weights

    group = ctx.engines()
    colocate.wake_engine(ctx, engine_id)  # colocated: the last turn may have been the trainer's
    engine = group.handle(engine_id)
    pushed = ray.get(engine.state_sha256.remote())
    path = engine_weights(ctx, group, engine_id, version).path
    reply = ray.get(engine.update_weights_from_disk.remote(path, str(version)))
    assert reply["success"], reply
    assert ray.get(engine.state_sha256.remote()) == pushed
    return pushed


@contextmanager
def kept_run(name: str, root: str) -> Iterator[tuple[Any, list[dict[str, Any]]]]:
    """Run ``name`` to its end (the plain driver: the same steps as the flow) with
    its actors kept for the checks; yields (ctx, metrics rows). Afterwards, or
    after a failure, its actors and placement groups end: the next test needs
    both GPUs."""
    from flows.config import load_config
    from flows.driver import run_plain
    from tasks.context import RunContext

    cfg = load_config(None, overrides(name, root))
    try:
        ctx, rows, secs = run_plain(cfg, quiet=True, keep_actors=True)
        print(f"\n{name}: {len(rows)} iterations in {secs:.1f}s")
        for r in rows:
            print({k: r.get(k) for k in ("iteration", "loss", "reward_mean", "reload_s")})
        yield ctx, rows
    finally:
        ends = RunContext(cfg=cfg, base_model_path="")  # names only: finds the run's actors
        try:
            ends.trainer().shutdown()
        finally:
            ends.engines().shutdown()  # after the trainer: it removes a colocated group
