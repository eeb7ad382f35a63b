"""The weight states ``bench.delta`` publishes: v0, then v1..vN after N steps.

- ``tiny-f32`` / ``tiny-bf16``: the tiny Llama, real AdamW steps of a
  next-token loss on random tokens (not RL: the same optimizer on another loss).
- ``0.5b``: Qwen2.5-0.5B's shapes, random weights moved by lr x N(0, 1) per
  step (synthetic: no gradient, no model), published as the bf16 rounding.
- ``real``: the project's own trainer (``training`` TrainActor, torch backend,
  one rank, no Ray) on the Qwen2.5-0.5B shape (``training.qwen2_shape``), bf16
  weights as ``configs/gpu-0.5b.yaml`` trains them: each step is a real GRPO
  ``train_step`` (old-logprob recompute, clipped loss, AdamW) over a fixed
  rollout batch, and each version is the trainer's own export state
  (``_hf_state``: HF names, tied output dropped), as ``export_hf`` publishes it.

Each state is a list of versions, each a list of ``TensorEntry`` over host
bytes, and the fraction of values each step changed.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import numpy as np

from storage.safetensors_io import TensorEntry


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even fp32 -> bf16, as uint16 bits (what torch's .to(bfloat16) does)."""
    u = a.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def qwen_05b_shapes() -> dict[str, tuple[int, ...]]:
    h, inter, kv, vocab, layers = 896, 4864, 128, 151936, 24
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    out["model.norm.weight"] = (h,)
    return out


def _entry(name: str, dtype: str, shape: tuple[int, ...], a: np.ndarray) -> TensorEntry:
    return TensorEntry(name=name, dtype=dtype, shape=shape, data=memoryview(a).cast("B"))


def synthetic_states(steps: int, lr: float) -> tuple[list[list[TensorEntry]], list[float]]:
    """bf16 entries of v0..v{steps} of the 0.5B shape and the fraction of bf16 values
    each step changed (vs the version before)."""
    rng = np.random.default_rng(0)
    shapes = qwen_05b_shapes()
    master = {}
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        if "norm" in name:
            master[name] = np.ones(n, np.float32)
        else:
            master[name] = (rng.standard_normal(n, dtype=np.float32) * 0.02).astype(np.float32)
    versions, fractions = [], []
    prev = None
    for step in range(steps + 1):
        if step:
            for w in master.values():
                w -= lr * rng.standard_normal(w.size, dtype=np.float32)
        bits = {k: bf16_bits(w) for k, w in master.items()}
        if prev is not None:
            changed = sum(int(np.count_nonzero(bits[k] != prev[k])) for k in bits)
            fractions.append(changed / sum(b.size for b in bits.values()))
        prev = bits
        versions.append([_entry(k, "BF16", shapes[k], b) for k, b in bits.items()])
    return versions, fractions


def _torch_states(states: list[dict[str, Any]]) -> tuple[list[list[TensorEntry]], list[float]]:
    """Entries of host state dicts and the fraction of values each step changed."""
    from training.export import tensor_entry

    fractions = []
    for prev, cur in zip(states, states[1:]):
        changed = sum(int((cur[k] != prev[k]).sum()) for k in cur)
        fractions.append(changed / sum(t.numel() for t in cur.values()))
    return [[tensor_entry(k, t) for k, t in s.items()] for s in states], fractions


def tiny_states(steps: int, dtype: str) -> tuple[list[list[TensorEntry]], list[float]]:
    import torch
    from transformers import LlamaForCausalLM

    from training.tiny_model import build_tokenizer, tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(len(build_tokenizer())))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    td = torch.float32 if dtype == "F32" else torch.bfloat16
    states = []
    for step in range(steps + 1):
        if step:
            ids = torch.randint(0, model.config.vocab_size, (16, 24))
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        states.append({k: v.detach().to(td).clone() for k, v in model.state_dict().items()})
    return _torch_states(states)


def real_states(
    steps: int, lr: float, device: str
) -> tuple[list[list[TensorEntry]], list[float], dict[str, Any]]:
    """v0..v{steps} of the 0.5B shape from the project's trainer (see the module doc),
    as host bf16 copies, with the changed fractions and what the steps were."""
    import torch

    from bench.train import rollouts
    from storage.config import StorageConfig
    from storage.run_store import RunStore
    from training.config import (
        ModelConfig,
        RunIdentity,
        TrainConfig,
        TrainerSections,
        WeightsConfig,
    )
    from training.group import actor_class
    from training.qwen2_shape import write_qwen2_05b

    # CUDA: a batch of the gpu-0.5b run's size (32 samples); CPU: 4 short samples, so
    # a step of a 0.5B model takes seconds on a few cores, not minutes.
    prompts, n, plen, rlen = (4, 8, 16, 48) if device == "cuda" else (2, 2, 8, 8)
    with tempfile.TemporaryDirectory(prefix="bench-delta-real-") as tmp:
        path = write_qwen2_05b(os.path.join(tmp, "model"))
        store_cfg = StorageConfig(root=os.path.join(tmp, "runs"))
        store = RunStore(store_cfg, "real")
        vocab = 151936
        for k in range(1, steps + 1):
            batch = rollouts(k, vocab, prompts, n, plen, rlen, alternate=True)
            store.write_rollouts(k, batch.to_json())
        cfg = TrainConfig(
            backend="torch",
            lr=lr,
            micro_batch_size=8,
            torch_threads=torch.get_num_threads(),
            num_gpus_per_worker=1.0 if device == "cuda" else 0.0,
        )
        sections = TrainerSections(
            train=cfg,
            model=ModelConfig(dtype="bfloat16"),
            storage=store_cfg,
            weights=WeightsConfig(),
        )
        identity = RunIdentity(name="real", seed=0, namespace="prefect-rl")
        actor = actor_class("torch")(identity, sections, 0, "127.0.0.1", 0)
        actor.setup()
        actor.init_from_base(str(path))

        def host() -> dict[str, Any]:
            # the trainer's export state (what export_hf publishes), copied to host memory
            return {k: t.detach().to("cpu", copy=True) for k, t in actor._hf_state().items()}

        states, step_s = [host()], []
        for k in range(1, steps + 1):
            t0 = time.perf_counter()
            actor.train_step(k)
            step_s.append(round(time.perf_counter() - t0, 3))
            states.append(host())
        actor = None
        if device == "cuda":
            torch.cuda.empty_cache()
    versions, fractions = _torch_states(states)
    meta = {
        "trainer": "training TrainActor (torch backend), GRPO train_step, AdamW",
        "model": "Qwen2.5-0.5B shape, random init (training.qwen2_shape), bf16",
        "device": device,
        "lr": lr,
        "samples_per_step": prompts * n,
        "tokens_per_sample": plen + rlen,
        "train_step_s": step_s,
    }
    return versions, fractions, meta
