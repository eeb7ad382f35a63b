"""``train.backend: megatron`` pushes HF-named weights to an engine over every
transport the GPU machine can run: CUDA IPC (streamed, then resident), disk
(export + reload), and a colocated RL run with the tensor transport.

Before, the push walked the raw megatron state dict (which holds ``_extra_state``
entries set to None, and fused qkv / fc1) and failed at the first reload.
"""

from __future__ import annotations

import uuid

import pytest
import ray
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("megatron.core")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def test_megatron_pushes_hf_weights_over_cuda_ipc_and_disk(ray_cluster, tmp_path, tiny_model_dir):
    from engines.config import EngineConfig
    from engines.group import EngineGroup
    from storage.config import StorageConfig
    from storage.run_store import RunStore
    from training.config import (
        ModelConfig,
        RunIdentity,
        TrainConfig,
        TrainerSections,
        WeightsConfig,
    )
    from training.group import TrainGroup
    from training.tiny_model import write_tiny_model

    run = f"mcore-push-{uuid.uuid4().hex[:6]}"
    other = str(write_tiny_model(tmp_path / "other", seed=1))
    storage = StorageConfig(root=str(tmp_path / "runs"))
    sections = TrainerSections(
        train=TrainConfig(backend="megatron", num_gpus_per_worker=0.4, num_cpus_per_worker=0.5),
        model=ModelConfig(),
        storage=storage,
        weights=WeightsConfig(),
    )
    trainer = TrainGroup(
        RunIdentity(name=run, seed=0, namespace="prefect-rl"), sections, placement=None, fence=None
    )
    engines = EngineGroup(run, EngineConfig(num_gpus_per_engine=0.4, num_cpus_per_engine=0.5))
    try:
        trainer.create(tiny_model_dir)
        engines.start(other, weight_version=0)
        engine = engines.handle(0)
        before = ray.get(engine.state_sha256.remote())
        ray.get(engine.update_weights_from_disk.remote(tiny_model_dir, "0"))
        base = ray.get(engine.state_sha256.remote())
        paths = []
        for _ in range(2):
            ray.get(engine.update_weights_from_disk.remote(other, "0"))
            out = trainer.push_weights(engine, "tensor", 64 * 1024, flush_cache=False)
            paths.append(out["path"])
            # megatron -> HF conversion is exact: the engine holds the base model's bytes
            assert ray.get(engine.state_sha256.remote()) == base != before
        assert paths == ["streamed", "resident"]
        trainer.export_hf(1, 0, None)  # the disk transport: publish, then reload
        ray.get(engine.update_weights_from_disk.remote(other, "0"))
        path = RunStore(storage, run).local_version_dir(1)
        assert ray.get(engine.update_weights_from_disk.remote(path, "1"))["success"]
        assert ray.get(engine.state_sha256.remote()) == base
    finally:
        trainer.shutdown()
        engines.shutdown()


def test_colocated_megatron_run_with_tensor_transport(ray_cluster, tmp_path):
    from flows.config import load_config
    from flows.driver import run_plain

    cfg = load_config(
        None,
        {
            "run.name": "megatron-colocated-tensor",
            "run.iterations": 1,
            "storage.root": str(tmp_path / "runs"),
            "rollout.batch_size": 4,
            "rollout.n_samples_per_prompt": 4,
            "train.backend": "megatron",
            "model.dtype": "bfloat16",
            "weights.transport": "tensor",
            "placement.colocate": True,
            "train.num_gpus_per_worker": 0.5,
            "engines.num_gpus_per_engine": 0.5,
            "train.num_cpus_per_worker": 0.5,
            "engines.num_cpus_per_engine": 0.5,
            "tasks.retry_delay_s": [0.1],
        },
    )
    from tasks import steps

    # The actors stay up for the check: after run_plain's shutdown, verify_engine would
    # start a fresh engine (holding half the GPU) that no one stops.
    ctx, rows, _ = run_plain(cfg, quiet=True, keep_actors=True)
    try:
        assert [r["iteration"] for r in rows] == [1]
        assert steps.verify_engine(ctx, 1, 0)["verified"] is True  # it serves pushed v1
    finally:
        ctx.trainer().shutdown()
        ctx.engines().shutdown()
