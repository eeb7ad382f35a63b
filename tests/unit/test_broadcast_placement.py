"""``weights.transport: distributed`` is refused at config time wherever Ray may
put two ranks of one NCCL broadcast group on one GPU, not only with colocation."""

from __future__ import annotations

import pytest

from flows.config import load_config

DIST = {"weights.transport": "distributed"}


@pytest.mark.parametrize(
    "gpus",
    [
        {"train.num_gpus_per_worker": 0.5, "engines.num_gpus_per_engine": 0.5},
        {"train.num_gpus_per_worker": 0.4, "engines.num_gpus_per_engine": 0.4},
        {"engines.num_gpus_per_engine": 0.5, "engines.tp_size": 2},
    ],
)
def test_broadcast_ranks_that_can_share_a_gpu_are_refused_with_the_fix(gpus):
    with pytest.raises(ValueError) as err:
        load_config(None, {**DIST, **gpus})
    msg = str(err.value)
    assert "one GPU" in msg and "weights.transport" in msg and "tensor" in msg
    assert "num_gpus 1" in msg  # the fix: whole GPUs, or CUDA IPC


@pytest.mark.parametrize(
    "gpus",
    [
        {},  # CPU: gloo has no such limit
        {"train.num_gpus_per_worker": 1.0, "engines.num_gpus_per_engine": 1.0},
        {"train.num_gpus_per_worker": 0.6, "engines.num_gpus_per_engine": 0.6},
        {"train.num_gpus_per_worker": 0.5, "engines.num_gpus_per_engine": 1.0},
    ],
)
def test_placements_that_cannot_share_a_gpu_load(gpus):
    assert load_config(None, {**DIST, **gpus}).weights.transport == "distributed"


def test_the_same_fractions_with_the_tensor_transport_load():
    gpus = {"train.num_gpus_per_worker": 0.5, "engines.num_gpus_per_engine": 0.5}
    assert load_config(None, {"weights.transport": "tensor", **gpus})
