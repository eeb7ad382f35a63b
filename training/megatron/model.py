"""megatron-core ``GPTModel`` for Llama/Qwen2 checkpoints, and the process groups.

Owns: the HF config -> ``TransformerConfig`` mapping (local layer spec, no
Transformer Engine, no apex fusions), building the model (bf16 through
megatron's ``Float16Module``), loading/reading HF-named weights through
``convert``, ``parallel_state`` set-up, and ``HFView``, which gives the model
the HF call signature (``model(input_ids=..., attention_mask=...).logits``) so
the torch backend's ``token_logprobs`` and the shared GRPO loss run unchanged.
Never reads storage and never knows about iterations or rollouts.

Pipeline parallelism is not run here: with PP > 1 a forward needs megatron's
pipeline schedules, which this backend does not drive yet (``check_layout``
refuses it).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from training.megatron.convert import (
    ModelSpec,
    check_tp,
    gather_tp,
    hf_to_megatron,
    megatron_to_hf,
    spec_from_hf_config,
    split_tp,
    stream_megatron_to_hf,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def rope_theta(hf_cfg: Any) -> float:
    """RoPE base; refuses scaled RoPE variants, which the local spec does not reproduce."""
    params = getattr(hf_cfg, "rope_parameters", None) or {}
    scaling = getattr(hf_cfg, "rope_scaling", None) or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind != "default":
        raise ValueError(f"rope_type {kind!r} is not supported by the megatron backend; use torch")
    theta = getattr(hf_cfg, "rope_theta", None) or params.get("rope_theta")
    return float(theta if theta is not None else 10000.0)


def check_layout(world_size: int, tp: int, pp: int, spec: ModelSpec) -> int:
    """Data-parallel size for ``world_size`` ranks; ValueError naming the fix otherwise."""
    if pp != 1:
        raise ValueError(
            "train.megatron.pipeline_parallel > 1 needs megatron's pipeline schedules, which "
            "this backend does not run yet; set train.megatron.pipeline_parallel: 1"
        )
    if world_size % (tp * pp):
        raise ValueError(
            f"train.num_workers={world_size} is not a multiple of tensor_parallel * "
            f"pipeline_parallel = {tp * pp}; change num_workers or the parallel sizes"
        )
    check_tp(spec, tp)
    return world_size // (tp * pp)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(
    rank: int,
    world_size: int,
    addr: str,
    port: int,
    tp: int,
    pp: int,
    seed: int,
    device: torch.device,
) -> None:
    """torch.distributed (NCCL on GPU, gloo on CPU) + megatron ``parallel_state``.

    megatron needs a process group even for one rank, so one is always made.
    On CUDA it seeds megatron's model-parallel RNG tracker."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        if world_size == 1 and not port:
            addr, port = "127.0.0.1", free_port()
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=10),
        )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def transformer_config(
    hf_cfg: Any, spec: ModelSpec, dtype: str, tp: int, pp: int, cpu_init: bool
) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    if getattr(hf_cfg, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported by the megatron backend")
    bf16 = dtype == "bfloat16"
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_cfg.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        bf16=bf16,
        params_dtype=DTYPES[dtype],
        use_cpu_initialization=cpu_init,
        perform_initialization=False,  # every weight is overwritten from the checkpoint
        # The fused kernels need apex / Transformer Engine; the local spec runs without.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def build_gpt(hf_cfg: Any, dtype: str, tp: int, pp: int, device: torch.device) -> nn.Module:
    """An uninitialised ``GPTModel`` (local spec) for ``hf_cfg`` on ``device``.
    Needs ``parallel_state`` initialised. CPU builds use ``use_cpu_initialization``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = spec_from_hf_config(hf_cfg)
    cfg = transformer_config(hf_cfg, spec, dtype, tp, pp, cpu_init=device.type == "cpu")
    gpt = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=spec.vocab_size,
        max_sequence_length=int(hf_cfg.max_position_embeddings),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_cfg),
        share_embeddings_and_output_weights=spec.tied,
        parallel_output=False,  # full-vocab logits on every TP rank, as HF returns them
    )
    return gpt.to(device) if device.type != "cpu" else gpt


def read_hf_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files of an HF directory (CPU)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {path}; the megatron backend reads safetensors"
        )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_hf_state(gpt: nn.Module, hf_state: dict[str, torch.Tensor], tp: int, tp_rank: int) -> None:
    """Convert a full HF state dict and load this TP rank's shard into ``gpt``."""
    spec = spec_from_hf_config(gpt.hf_config) if hasattr(gpt, "hf_config") else None
    assert spec is not None, "build the model with wrap() so it carries its HF config"
    shard = split_tp(hf_to_megatron(hf_state, spec), tp)[tp_rank]
    own = gpt.state_dict()
    for name, value in own.items():  # _extra_state entries are kept as the model has them
        if name.endswith("_extra_state"):
            shard[name] = value
    gpt.load_state_dict(shard, strict=True)


def local_state(gpt: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's megatron tensors (detached, CPU), without ``_extra_state``."""
    return {
        n: t.detach().to("cpu")
        for n, t in gpt.state_dict().items()
        if isinstance(t, torch.Tensor) and not n.endswith("_extra_state")
    }


def full_hf_state(gpt: nn.Module, tp: int) -> dict[str, torch.Tensor]:
    """Full HF-named CPU state dict, gathered over the TP group. Collective over
    the TP group (a no-op with TP = 1)."""
    state = local_state(gpt)
    if tp > 1:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        for name, t in gpt.state_dict().items():  # same order on every rank
            if not isinstance(t, torch.Tensor) or name.endswith("_extra_state"):
                continue
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.detach().contiguous(), group=group)
            for r in range(tp):
                shards[r][name] = parts[r].to("cpu")
        state = gather_tp(shards)
    return megatron_to_hf(state, spec_from_hf_config(gpt.hf_config))


def iter_full_megatron(gpt: nn.Module, tp: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(megatron name, full tensor on the device) in the model's order, one tensor
    gathered over the TP group at a time; ``_extra_state`` entries are skipped.
    Collective over the TP group: iterate it on every rank."""
    for name, t in gpt.state_dict().items():
        if not isinstance(t, torch.Tensor) or name.endswith("_extra_state"):
            continue
        t = t.detach()
        if tp > 1:
            import torch.distributed as dist
            from megatron.core import parallel_state as ps

            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
            t = gather_tp([{name: p} for p in parts])[name]
        yield name, t


def iter_hf_tensors(gpt: nn.Module, tp: int) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of the model, converted one decoder layer at a time as
    they stream (what a weight push sends). Collective over the TP group."""
    spec = spec_from_hf_config(gpt.hf_config)
    return stream_megatron_to_hf(iter_full_megatron(gpt, tp), spec)


class HFView(nn.Module):
    """The megatron model behind HF's causal-LM call signature.

    ``attention_mask`` is accepted and not used: batches are right-padded, so
    the causal mask alone keeps pads out of every real token's attention, and
    pad positions are outside the loss mask."""

    def __init__(self, module: nn.Module, gpt: nn.Module, hf_config: Any) -> None:
        super().__init__()
        self.module = module  # Float16Module(gpt) for bf16, else gpt itself
        self.gpt = gpt
        self.config = hf_config

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None, use_cache: bool = False):
        b, t = input_ids.shape
        pos = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)
        logits = self.module(input_ids, pos, attention_mask=None)
        return SimpleNamespace(logits=logits)


def wrap(gpt: nn.Module, hf_config: Any, dtype: str) -> HFView:
    """bf16 goes through megatron's ``Float16Module`` (casts inputs to bf16,
    logits back to fp32); fp32 runs the model as built."""
    gpt.hf_config = hf_config
    module = gpt
    if dtype == "bfloat16":
        from megatron.core.transformer.module import Float16Module

        module = Float16Module(gpt.config, gpt)
    return HFView(module, gpt, hf_config)
