"""Colocated placement on a CUDA machine: a train rank and an engine with 0.5 GPU
each share one GPU, and each one's sleep frees the GPU memory its weights hold
(torch_memory_saver where installed, else moves to host memory) without
changing them; then a colocated run with the tensor transport (CUDA IPC
between the two processes on one GPU).

Run on the GPU machine: ``.venv/bin/pytest -q -m gpu tests/integration/test_colocate_gpu.py``
"""

from __future__ import annotations

import pytest
import ray
import torch
from safetensors.torch import load_file

from flows.config import load_config
from flows.driver import run_plain
from tasks import lease as run_lease
from tasks.prepare import prepare_run

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

GPU = {
    "placement.colocate": True,
    "train.num_gpus_per_worker": 0.5,
    "engines.num_gpus_per_engine": 0.5,
    "train.num_cpus_per_worker": 0.5,
    "engines.num_cpus_per_engine": 0.5,
}
PROBE = [[1, 5, 9, 12, 7, 20, 2], [1, 8, 8, 4, 29, 3, 11]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "sampling_seed": 1}


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> str:
    """A Llama of ~0.4 GB in float32: big enough that freeing it shows on the device."""
    from transformers import LlamaForCausalLM

    from training.tiny_model import build_tokenizer, tiny_llama_config

    out = tmp_path_factory.mktemp("colocate-gpu-model")
    tok = build_tokenizer()
    cfg = tiny_llama_config(len(tok))
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 1024, 2816, 8
    cfg.num_attention_heads, cfg.num_key_value_heads = 8, 8
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return str(out)


def _freed(before: dict, after: dict) -> int:
    # Physical memory the GPU got back (device-wide; the saver keeps paused tensors
    # "allocated" in torch's books, so allocated_bytes falls only for moves).
    return before["device_used_bytes"] - after["device_used_bytes"]


def test_offload_frees_the_shared_gpu_and_keeps_the_weights(ray_cluster, tmp_path, big_model):
    overrides = {**GPU, "run.name": "colo-gpu", "storage.root": str(tmp_path / "runs")}
    ctx = prepare_run(load_config(None, {**overrides, "model.path": big_model}))
    trainer, group = ctx.trainer(), ctx.engines()
    try:
        trainer.ensure_state(0, ctx.base_model_path)
        group.start(ctx.base_model_path, 0)
        rank, engine = trainer.actors()[0], group.handle(0)
        weights = load_file(f"{ctx.base_model_path}/model.safetensors")
        model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        scores = ray.get(rank.score.remote(PROBE))
        tokens = ray.get(engine.generate.remote([[1, 5, 6]], GREEDY))[0]["output_ids"]
        sha = ray.get(engine.state_sha256.remote())
        for cycle in range(2):  # the saver pauses in place from the second cycle on
            train_awake = trainer.onload()[0]  # both awake: reports read the device now
            eng_awake = ray.get(engine.resume_memory_occupation.remote())
            assert train_awake["mode"] == eng_awake["mode"] and eng_awake["mode"] != "cpu"

            eng_asleep = ray.get(engine.release_memory_occupation.remote())
            assert eng_asleep["state"] == "asleep" and eng_asleep["changed"]
            assert _freed(eng_awake, eng_asleep) >= 0.8 * model_bytes, (cycle, eng_asleep)
            if eng_asleep["mode"] == "move":
                assert eng_awake["allocated_bytes"] - eng_asleep["allocated_bytes"] >= model_bytes
            # The train rank sees the engine's memory go: they share one GPU.
            seen = trainer.onload()[0]
            assert _freed(train_awake, seen) >= 0.8 * model_bytes, (cycle, seen)

            train_asleep = trainer.offload()[0]
            assert train_asleep["state"] == "asleep"
            assert _freed(seen, train_asleep) >= 0.8 * model_bytes, (cycle, train_asleep)
            print(
                f"COLOCATE cycle {cycle} mode={eng_asleep['mode']} model={model_bytes / 1e9:.2f} GB: "
                f"engine release freed {_freed(eng_awake, eng_asleep) / 1e9:.2f} GB, "
                f"train offload freed {_freed(seen, train_asleep) / 1e9:.2f} GB"
            )

            # Wake in the order a rollout does, then check nothing changed.
            ray.get(engine.resume_memory_occupation.remote())
            out = ray.get(engine.generate.remote([[1, 5, 6]], GREEDY))[0]["output_ids"]
            assert out == tokens and ray.get(engine.state_sha256.remote()) == sha
            trainer.onload()
            assert torch.equal(ray.get(rank.score.remote(PROBE)), scores)
    finally:
        trainer.shutdown()
        group.shutdown()
        run_lease.release(ctx)  # renewals stopped first, then released


def test_colocated_gpu_run_with_the_tensor_transport(ray_cluster, tmp_path):
    cfg = load_config(
        None,
        {
            **GPU,
            "run.name": "colo-gpu-run",
            "run.iterations": 2,
            "storage.root": str(tmp_path / "runs"),
            "rollout.batch_size": 4,
            "rollout.n_samples_per_prompt": 4,
            "weights.transport": "tensor",
            "weights.publish_interval": 2,  # v1 only ever exists in memory
        },
    )
    ctx, rows, _ = run_plain(cfg, quiet=True)
    store = ctx.store
    assert [r["iteration"] for r in rows] == [1, 2]
    assert store.committed_versions() == [0, 2]
    assert {s["weight_version"] for s in store.read_rollouts(2)["samples"]} == {1}
    assert store.read_record(2, "train")["result"]["memory"] == {
        "train": ["awake"],
        "engines": {"0": "asleep"},
    }
    assert store.read_record(2, "reload-e0")["result"]["memory"] == {
        "train": ["awake"],
        "engines": {"0": "awake"},
    }
