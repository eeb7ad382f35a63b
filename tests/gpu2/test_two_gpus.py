"""RL runs that only two GPUs can show, on real Ray actors with the tiny model,
3 iterations each, every one verified (``two_gpu_runs.RUNS`` has the configs):

- ``distributed``: trainer on one GPU, engine on the other, weights broadcast
  over NCCL between them;
- an engine spanning both GPUs (``engines.tp_size: 2``, all-reduces over NCCL)
  fed by two FSDP ranks over CUDA IPC, colocated (train rank j and engine rank
  j share GPU j);
- two colocated 1-rank engines, one per GPU, fed by two FSDP ranks over CUDA IPC.

An engine of 2 ranks fed by ``distributed`` needs 3 GPUs (NCCL refuses two
ranks of one group on one GPU, and the trainer needs its own), so on two GPUs
the 2-rank engine is fed by ``tensor``.

Each run also checks where Ray put the actors, and that what the engine holds
after the last push is byte-equal to a disk reload of the published version.
Run: ``bash scripts/gpu2.sh`` on nvidia-h200-x2 (``pytest -m gpu tests/gpu2``).
"""

from __future__ import annotations

import pytest

from tests.gpu2.two_gpu_runs import (
    NEEDS_TWO,
    broadcast_groups,
    check_pushed_equals_published,
    check_verified_every_iteration,
    device_of,
    engine_devices,
    kept_run,
)

pytestmark = [pytest.mark.gpu, NEEDS_TWO]
NCCL = "ProcessGroupNCCL"  # the class of a torch.distributed NCCL group


def test_distributed_broadcasts_over_nccl_from_a_trainer_gpu_to_an_engine_gpu(
    ray_cluster, tmp_path
):
    with kept_run("nccl-broadcast", str(tmp_path / "runs")) as (ctx, rows):
        check_verified_every_iteration(ctx, rows, engines=1)  # v1 went by broadcast only
        rank0, engine = ctx.trainer().actors()[0], ctx.engines().handle(0)
        train_dev, engine_dev = device_of(rank0), engine_devices(engine)
        print(f"devices: trainer {train_dev}, engine {engine_dev}")
        assert len(engine_dev) == 1 and train_dev != engine_dev[0]
        sent, received = broadcast_groups(rank0, engine)
        assert sent == [NCCL] and received == [NCCL], (sent, received)
        check_pushed_equals_published(ctx, 0, 3)


def test_two_fsdp_ranks_feed_an_engine_spanning_both_gpus(ray_cluster, tmp_path):
    with kept_run("fsdp2-tp2-engine", str(tmp_path / "runs")) as (ctx, rows):
        check_verified_every_iteration(ctx, rows, engines=1)
        train_devs = [device_of(a) for a in ctx.trainer().actors()]
        ranks = engine_devices(ctx.engines().handle(0))
        print(f"devices: train ranks {train_devs}, engine ranks {ranks}")
        assert len(set(ranks)) == 2 and ranks == train_devs  # rank j beside train rank j
        check_pushed_equals_published(ctx, 0, 3)


def test_two_fsdp_ranks_feed_two_colocated_engines(ray_cluster, tmp_path):
    with kept_run("fsdp2-two-engines", str(tmp_path / "runs")) as (ctx, rows):
        check_verified_every_iteration(ctx, rows, engines=2)
        train_devs = [device_of(a) for a in ctx.trainer().actors()]
        engines = [engine_devices(ctx.engines().handle(e))[0] for e in (0, 1)]
        print(f"devices: train ranks {train_devs}, engines {engines}")
        assert len(set(engines)) == 2 and engines == train_devs
        shas = {check_pushed_equals_published(ctx, e, 3) for e in (0, 1)}
        assert len(shas) == 1  # both engines hold the same version 3
