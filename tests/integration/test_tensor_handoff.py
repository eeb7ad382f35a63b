"""The ``tensor`` transport between one train actor and one engine actor on the
same host: shared memory on CPU (CI), CUDA IPC with both actors on one GPU
(fractional num_gpus; ``gpu`` marker). The engine starts from other weights;
after the push it holds exactly what a disk reload of the trainer's weights gives."""

from __future__ import annotations

import uuid

import pytest
import ray
import torch

from engines.config import EngineConfig
from engines.group import EngineGroup
from storage.config import StorageConfig
from training.config import ModelConfig, RunIdentity, TrainConfig, TrainerSections, WeightsConfig
from training.group import TrainGroup
from training.tiny_model import write_tiny_model


def _handoff(tmp_path, tiny_model_dir: str, gpus: float) -> dict:
    """Push the trainer's weights five times into an engine that is reset to other
    weights before each push: the first push streams (and learns the layout), the
    second fills the resident staging buffer and sends it in full over Ray, the
    third only names the cached buffer, on the engine's update socket; the fourth
    goes to a restarted engine (a new engine: in full over Ray again), the fifth to
    that engine's own socket. Each must leave the engine equal to a disk reload."""
    run = f"handoff-{uuid.uuid4().hex[:6]}"
    other = str(write_tiny_model(tmp_path / "other", seed=1))  # the engine starts here
    train_cfg = TrainConfig(num_cpus_per_worker=0.5, num_gpus_per_worker=gpus)
    storage = StorageConfig(root=str(tmp_path / "runs"))
    sections = TrainerSections(
        train=train_cfg, model=ModelConfig(), storage=storage, weights=WeightsConfig()
    )
    trainer = TrainGroup(
        RunIdentity(name=run, seed=0, namespace="prefect-rl"), sections, placement=None, fence=None
    )
    engines = EngineGroup(run, EngineConfig(num_cpus_per_engine=0.5, num_gpus_per_engine=gpus))
    try:
        trainer.create(tiny_model_dir)
        engines.start(other, weight_version=0)
        engine = engines.handle(0)
        before = ray.get(engine.state_sha256.remote())
        pushes, states = [], []
        for i in range(5):
            if i == 3:
                engine = engines.restart(0, other, 0)
            else:
                ray.get(engine.update_weights_from_disk.remote(other, "0"))
            assert ray.get(engine.state_sha256.remote()) == before
            ray.get(engine.pause_generation.remote("in_place"))
            pushes.append(trainer.push_weights(engine, "tensor", 16 * 1024, flush_cache=i == 0))
            ray.get(engine.continue_generation.remote())
            states.append(ray.get(engine.state_sha256.remote()))
        info = ray.get(engine.model_info.remote())
        ray.get(engine.update_weights_from_disk.remote(tiny_model_dir, "0"))
        from_disk = ray.get(engine.state_sha256.remote())
        return {
            "before": before,
            "states": states,
            "disk": from_disk,
            "info": info,
            "pushes": pushes,
        }
    finally:
        trainer.shutdown()
        engines.shutdown()


def _check_handoff(r: dict) -> None:
    assert r["before"] != r["disk"]
    assert r["states"] == [r["disk"]] * 5  # every path gives the bytes of a disk reload
    assert [p["path"] for p in r["pushes"]] == ["streamed"] + ["resident"] * 4
    assert [p.get("signal") for p in r["pushes"]] == [None, "ray", "socket", "ray", "socket"]
    # A single train rank's weights are the staging buffer: no push copies them first.
    assert [p.get("bound") for p in r["pushes"]] == [None] + [True] * 4
    assert r["pushes"][0]["buckets"] > 1 and r["pushes"][1]["buckets"] == 1
    assert r["info"]["weight_version"] == "0"


def test_tensor_handoff_over_shared_memory(ray_cluster, tmp_path, tiny_model_dir):
    _check_handoff(_handoff(tmp_path, tiny_model_dir, gpus=0.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run pytest -m gpu there)")
def test_tensor_handoff_over_cuda_ipc(ray_cluster, tmp_path, tiny_model_dir):
    r = _handoff(tmp_path, tiny_model_dir, gpus=0.4)
    print(r["pushes"], r["info"]["device"])
    assert r["info"]["device"].startswith("cuda")
    _check_handoff(r)
