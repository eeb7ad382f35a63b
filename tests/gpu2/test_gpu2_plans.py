"""What can be checked of the 2-GPU runs without GPUs (runs in CI): each run's
config passes the config checks and asks for exactly the two GPUs of the
nvidia-h200-x2 machine (more would leave a placement group waiting there until
its timeout, using up the one device call), and the 2-GPU bench refuses a
machine without two GPUs, naming the fix."""

from __future__ import annotations

import pytest
import torch

from flows.config import load_config
from tasks.context import RunContext
from tests.gpu2.two_gpu_runs import RUNS, overrides


def gpus_asked(cfg) -> float:
    """GPUs the run's placement groups reserve: a whole one per colocated bundle,
    else each rank's fraction."""
    placement = RunContext(cfg=cfg, base_model_path="").placement()
    if placement is not None:
        return sum(b.get("GPU", 0.0) for b in placement.bundles)
    e, t = cfg.engines, cfg.train
    return t.num_workers * t.num_gpus_per_worker + e.num_engines * e.tp_size * e.num_gpus_per_engine


@pytest.mark.parametrize("name", sorted(RUNS))
def test_each_two_gpu_run_loads_and_asks_for_both_gpus(name, tmp_path):
    cfg = load_config(None, overrides(name, str(tmp_path)))
    assert gpus_asked(cfg) == 2.0
    assert cfg.weights.transport in ("tensor", "distributed")  # pushes, verified as version k


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has two GPUs")
def test_two_gpu_bench_refuses_fewer_gpus_naming_the_fix():
    from bench.transport_2gpu import main

    with pytest.raises(SystemExit, match=r"needs 2 CUDA GPUs.*nvidia-h200-x2.*scripts/gpu2\.sh"):
        main(["--sizes", "10"])
