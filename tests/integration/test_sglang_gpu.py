"""Real SGLang as the rollout engine on a CUDA machine: every weight path and whole runs.

Needs CUDA and SGLang's own environment (an unpacked site folder, as
``../shared/device/sglang/README.md`` says) named by ``PREFECT_RL_SGLANG_SITE``;
run on the GPU machine with ``pytest -m "gpu and sglang"``. Each SGLang start
costs tens of seconds, so the tests share one Ray cluster and start as few
servers as they can. The model is the Qwen2.5-0.5B shape (random init, bf16).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from flows.config import load_config
from flows.driver import run_plain
from tasks import lease as run_lease
from tasks.faults import kill_engine
from tasks.prepare import prepare_run

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]
SITE = os.environ.get("PREFECT_RL_SGLANG_SITE")
if not torch.cuda.is_available() or not SITE:
    pytest.skip("needs CUDA and PREFECT_RL_SGLANG_SITE", allow_module_level=True)

# The trimmed kernel package of the test machine needs these backends; CUDA graphs
# are off in tests (their capture is most of a start; the benches keep them), and so
# is the server's warmup request (a second's sleep and a generate: the engine's own
# readiness check generates anyway).
SGLANG_ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch"]
TEST_ARGS = [*SGLANG_ARGS, "--disable-cuda-graph", "--skip-server-warmup"]
PROBE = [1, 5, 9, 12, 7, 20, 2, 8]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> str:
    from training.qwen2_shape import write_qwen2_05b

    return str(write_qwen2_05b(tmp_path_factory.mktemp("qwen2-0.5b")))


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """A Llama of ~0.98 GB in bf16 (the bytes of the 0.5B shape): SGLang reads weights
    back by name for Llama models only (``/get_weights_by_name``)."""
    from transformers import LlamaForCausalLM

    from training.tiny_model import build_tokenizer, tiny_llama_config

    out = tmp_path_factory.mktemp("llama-1gb")
    tok = build_tokenizer()
    cfg = tiny_llama_config(len(tok))
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 1024, 2816, 38
    cfg.num_attention_heads, cfg.num_key_value_heads = 16, 8
    cfg.max_position_embeddings = 2048
    torch.manual_seed(0)
    LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def sglang_config(tmp_path, name: str, colocate: bool = False, **more):
    """The run config: what the server runs (its folder, flags) in a config file, as
    overrides may not choose it (``flows.config.SGLANG_CODE_KEYS``); the rest as overrides."""
    args = [*TEST_ARGS, "--enable-memory-saver"] if colocate else TEST_ARGS
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        json.dumps(
            {"engines": {"kind": "sglang", "sglang": {"pythonpath": [SITE], "extra_args": args}}}
        )
    )
    sets = {
        "run.name": name,
        "run.iterations": 2,
        "storage.root": str(tmp_path / "runs"),
        "model.dtype": "bfloat16",
        "engines.num_gpus_per_engine": 0.5,
        "engines.sglang.mem_fraction_static": 0.3,
        "engines.sglang.log_dir": str(tmp_path / "sglang-logs"),
        "train.num_gpus_per_worker": 0.5,
        "rollout.batch_size": 8,
        "rollout.n_samples_per_prompt": 4,
        "rollout.max_new_tokens": 8,
        **({"placement.colocate": True} if colocate else {}),
        **more,
    }
    return load_config(path, sets)


def _greedy(engine) -> list[int]:
    return ray.get(engine.generate.remote([PROBE], GREEDY))[0]["output_ids"]


def test_tensor_push_lands_bit_exact_and_is_timed(ray_cluster, tmp_path, llama):
    """Serve other weights from disk, push trainer state v0 by CUDA IPC: the server then
    holds the trainer's exact values and generates exactly what it did at the start."""
    from tests.engines.conftest import write_variant

    cfg = sglang_config(tmp_path, "sgl-push", **{"model.path": llama})
    ctx = prepare_run(cfg)
    trainer, group = ctx.trainer(), ctx.engines()
    try:
        trainer.ensure_state(0, ctx.base_model_path)
        group.start(ctx.base_model_path, 0)
        engine = group.handle(0)
        assert ray.get(engine.model_info.remote())["weight_wire"] == "sglang"
        start = _greedy(engine)
        other = write_variant(Path(ctx.base_model_path), tmp_path / "scaled", scale=1.5)
        assert ray.get(engine.update_weights_from_disk.remote(str(other), "7"))["success"]
        assert _greedy(engine) != start and ray.get(engine.get_weight_version.remote()) == "7"

        bucket = 2 << 30  # the whole model in one payload, as the seed's push measured it
        out = trainer.push_weights(engine, "tensor", bucket, True, group_name="t")
        assert out["path"] == "streamed" and out["version"] == 0
        assert ray.get(engine.get_weight_version.remote()) == "0"
        base = load_file(f"{ctx.base_model_path}/model.safetensors")
        for name in ("model.embed_tokens.weight", "model.layers.3.mlp.down_proj.weight"):
            served = ray.get(engine.get_weights_by_name.remote(name, 4))  # the first 4 rows
            want = base[name][:4].float().tolist()
            assert served == want, name
        assert _greedy(engine) == start

        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            trainer.push_weights(engine, "tensor", bucket, False, group_name="t")
            times.append(time.perf_counter() - t0)
        nbytes = out["bytes"]
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        copies = []
        for _ in range(6):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            copies.append(time.perf_counter() - t0)
        push_ms, copy_ms = statistics.median(times[1:]) * 1e3, statistics.median(copies[1:]) * 1e3
        print(
            f"SGLANG tensor push {nbytes / 1e9:.2f} GB in {out['buckets']} bucket(s): "
            f"median {push_ms:.1f} ms (first {times[0] * 1e3:.1f} ms), device copy "
            f"{copy_ms:.2f} ms, ratio {copy_ms / push_ms:.3f}x a copy"
        )
    finally:
        trainer.shutdown()
        group.shutdown()
        run_lease.release(ctx)  # stops the renewals prepare_run started, then releases


def test_distributed_on_one_gpu_is_refused_before_the_run(tmp_path, qwen):
    """NCCL refuses two ranks on one GPU: the config says so before any state exists."""
    with pytest.raises(ValueError, match="NCCL"):
        sglang_config(
            tmp_path, "sgl-dist", **{"model.path": qwen, "weights.transport": "distributed"}
        )
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "transport,colocate",
    [("disk", False), ("tensor", False), ("tensor", True)],
    ids=["disk", "tensor", "colocated-tensor"],
)
def test_sglang_run_commits_verifies_and_resumes(ray_cluster, tmp_path, qwen, transport, colocate):
    more = {"model.path": qwen, "weights.transport": transport}
    name = f"sgl-{transport}-{'colo' if colocate else 'own'}"
    cfg = sglang_config(tmp_path, name, colocate, **more)
    ctx, rows, _ = run_plain(cfg, quiet=True, keep_actors=True)
    store = ctx.store
    assert [r["iteration"] for r in rows] == [1, 2]
    for k in (1, 2):
        audit = store.read_record(k, "verify-e0")
        assert audit is not None and audit["result"]["served"] == str(k)
        versions = {s["weight_version"] for s in store.read_rollouts(k)["samples"]}
        assert versions == {k - 1}
    if colocate:
        memory = store.read_record(2, "train")["result"]["memory"]
        assert memory == {"train": ["awake"], "engines": {"0": "asleep"}}
    # A killed engine: the next iteration restarts it and serves the right version.
    kill_engine(ctx.engines(), 0)
    cfg3 = sglang_config(tmp_path, name, colocate, **more, **{"run.iterations": 3})
    ctx3, rows3, _ = run_plain(cfg3, quiet=True)
    assert [r["iteration"] for r in rows3] == [3]
    assert ctx3.store.read_record(3, "verify-e0")["result"]["served"] == "3"
    assert {s["weight_version"] for s in ctx3.store.read_rollouts(3)["samples"]} == {2}


@pytest.mark.parametrize("transport", ["disk", "tensor"])
def test_sglang_serves_lora_adapter_versions(ray_cluster, tmp_path, qwen, transport):
    """train.lora: SGLang is launched with LoRA on, each version is loaded as adapter
    ``v{k}`` (from the version folder, or pushed as tensors with their checksums),
    rollouts name the version they sample from, only the versions the staleness needs
    stay loaded, and a killed engine comes back on v0 plus the newest adapter."""
    more = {"model.path": qwen, "weights.transport": transport, "train.lora.rank": 8}
    name = f"sgl-lora-{transport}"
    cfg = sglang_config(tmp_path, name, **more, **{"run.iterations": 3})
    ctx, rows, _ = run_plain(cfg, quiet=True, keep_actors=True)
    store = ctx.store
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    for k in (1, 2, 3):
        assert store.read_manifest(k).adapter is not None
        assert store.read_record(k, "verify-e0")["result"]["served"] == str(k)
        assert {s["weight_version"] for s in store.read_rollouts(k)["samples"]} == {k - 1}
    with ctx.engines().client(0) as client:  # max_staleness 0: v2 and v3 stay loaded
        assert client.models()[1:] == ["v2", "v3"]
    kill_engine(ctx.engines(), 0)
    cfg4 = sglang_config(tmp_path, name, **more, **{"run.iterations": 4})
    ctx4, rows4, _ = run_plain(cfg4, quiet=True)
    assert [r["iteration"] for r in rows4] == [4]
    assert ctx4.store.read_record(4, "verify-e0")["result"]["served"] == "4"
    assert {s["weight_version"] for s in ctx4.store.read_rollouts(4)["samples"]} == {3}
