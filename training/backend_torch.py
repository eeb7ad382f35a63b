"""Torch backend: HF model building, FSDP2 sharding, logprobs and full state dicts.

Owns how a model lives on a rank: device, process group, ``fully_shard`` per
decoder layer + root, and gathering/loading full (unsharded) state dicts. Never
reads or writes storage and never knows about iterations or rollouts.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import AutoModelForCausalLM

from training.config import LoraConfig
from training.logprobs import Kernel, token_stats
from training.lora import add_adapters

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# cpu_offload + full_state_dict: rank 0 gets CPU tensors, the other ranks get {}.
FULL_OFFLOADED = StateDictOptions(full_state_dict=True, cpu_offload=True)
FULL = StateDictOptions(full_state_dict=True)


def pick_device(num_gpus_per_worker: float) -> torch.device:
    if num_gpus_per_worker > 0 and torch.cuda.is_available():
        # Ray sets CUDA_VISIBLE_DEVICES per actor, so the actor's GPU is always 0.
        return torch.device("cuda", 0)
    return torch.device("cpu")


def init_distributed(
    rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device
) -> None:
    """Join the trainer process group (gloo on CPU, NCCL on GPU); no-op for one rank."""
    if world_size <= 1 or dist.is_initialized():
        return
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=10),
    )


def set_determinism(device: torch.device) -> None:
    """Deterministic kernels where torch has them. On a GPU, cuBLAS needs a fixed
    workspace for its GEMMs to be (it reads the variable when its handle is made, at
    the first GEMM of the process), and fp32 matmuls use TF32. What stays
    nondeterministic on a GPU (atomics in some backward kernels) warns instead of
    failing (Python shows each warning once): GPU runs are best-effort."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.use_deterministic_algorithms(True, warn_only=True)


def adamw(model: nn.Module, lr: float, weight_decay: float, device: torch.device) -> Any:
    """AdamW over ``model``'s trainable parameters (all of them, or a LoRA model's
    adapters): fused on a GPU (one kernel for every parameter); on CPU one parameter
    at a time (``foreach=False``), in a fixed order, so a resumed run's bytes match."""
    fused = device.type == "cuda"
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=lr,
        weight_decay=weight_decay,
        fused=fused or None,
        foreach=None if fused else False,
    )


def build_model(
    path: str,
    dtype: str,
    device: torch.device,
    world_size: int,
    compute_dtype: str | None = None,
    lora: LoraConfig | None = None,
    seed: int = 0,
    compiled: bool = False,
) -> nn.Module:
    """Load the HF causal LM at ``path`` with ``dtype`` weights; FSDP2-shard it when
    ``world_size`` > 1, each layer gathered in ``compute_dtype`` (one rank computes in
    it on a ``training.mixed_precision.ComputeCopy`` instead). ``lora``: adapters put
    in before sharding (``training.lora.add_adapters``, drawn from ``seed``);
    ``compiled``: each decoder layer compiled (``compile_layers``), before sharding."""
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[dtype], attn_implementation="sdpa"
    )
    if lora is not None:
        add_adapters(model, lora, seed)
    model.to(device)
    if compiled:
        compile_layers(model)
    if world_size > 1:
        shard_model(model, device, world_size, compute_dtype)
    return model


def build_value_model(
    path: str, dtype: str, device: torch.device, world_size: int, seed: int
) -> nn.Module:
    """A value model for PPO's critic: the HF checkpoint at ``path`` with a fresh
    scalar head (``AutoModelForTokenClassification``, one label), its head seeded by
    ``seed`` so every rank and every rebuild starts the same; no head dropout (a
    regression target wants no noise). FSDP2-sharded when ``world_size`` > 1."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0  # HF's head defaults to 0.1 dropout when unset
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_pretrained(
        path, config=config, dtype=DTYPES[dtype], attn_implementation="sdpa"
    )
    model.to(device)
    if world_size > 1:
        shard_model(model, device, world_size)
    return model


def token_values(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, packed: bool = False
) -> torch.Tensor:
    """The value model's V at each position that predicts a next token, [B, T-1]
    float32: the same positions as ``token_logprobs`` (V_t is the value of the
    state that emits token t+1). ``packed`` as in ``token_logprobs``."""
    if not packed:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return out[:, :-1, 0].float()
    flat, positions, keep = pack_rows(input_ids, attention_mask)
    # use_cache=False matters: with a cache HF skips the packed-sequence mask.
    out = model(input_ids=flat, position_ids=positions, use_cache=False).logits
    return _unpack(out[0, :-1, 0][keep].float(), attention_mask)


def _unpack(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Packed next-token values [M] back in the padded layout [B, T-1], 0 on padding;
    row-major boolean indexing walks the padded targets in the packed order."""
    targets = attention_mask[:, 1:].bool()
    out = values.new_zeros(targets.shape)
    out[targets] = values
    return out


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of an HF causal LM: its modules of the classes it names in
    ``_no_split_modules`` (what FSDP shards and ``compile_layers`` compiles one by one)."""
    layer_types = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_types]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class in _no_split_modules; "
            "the torch backend cannot shard or compile it per layer"
        )
    return layers


def compile_layers(model: nn.Module) -> None:
    """``torch.compile`` each decoder layer in place (dynamic shapes: micro-batches
    differ in rows and length). Every layer runs the same code, so they share one
    compiled graph; HF's per-layer Python and the small norm, rotary and activation
    kernels between the matmuls become a few fused kernels, which is where a small
    model's step spends its time on a GPU. Call it on the module that runs (a
    ``ComputeCopy``'s, not its master: a compiled module's deepcopy would still call
    the original) and before FSDP2 wraps the layers."""
    for layer in decoder_layers(model):
        layer.compile(dynamic=True)


def should_compile_layers(
    setting: str, device: torch.device, world_size: int = 1, lora: bool = False
) -> bool:
    """``train.compile_layers`` on ``device``: ``auto`` is on for CUDA with Triton at
    one rank of full fine-tuning, where it was measured. FSDP2's ranks keep eager
    layers unless ``on``, and so does LoRA: on one H100 its compiled layers score
    SGLang's samples at ``rollout_logprob_kl`` 0.017 (max 0.027) where eager layers
    score 0.0024 and compiled full fine-tuning 0.0022 (SmolLM2, 20 iterations), with
    every layer compiled once (no recompiles). The trainer's own compiled and eager
    LoRA layers agree as closely as full fine-tuning's do, and on CPU in bf16 the gap
    does not appear, so its cause lies between the GPU kernels and SGLang's LoRA
    kernels and is not yet found."""
    if setting == "auto":
        cuda = device.type == "cuda" and importlib.util.find_spec("triton") is not None
        return cuda and world_size == 1 and not lora
    if setting not in ("on", "off"):
        raise ValueError(f"compile_layers {setting!r}: choose auto, on or off")
    return setting == "on"


def shard_model(
    model: nn.Module, device: torch.device, world_size: int, compute_dtype: str | None = None
) -> None:
    """``fully_shard`` each decoder layer (HF's ``_no_split_modules``), then the root,
    so each layer's parameters are gathered only while that layer runs. With
    ``compute_dtype``, each gathered layer is cast to it (the master weights stay in
    their dtype) and gradients are reduced in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[compute_dtype] if compute_dtype else None,
        reduce_dtype=torch.float32,
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    positions: torch.Tensor | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    packed: bool = False,
    kernel: Kernel = "eager",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each next token, [B, T-1] float32, under ``log_softmax(logits /
    temperature)``: the distribution the engines sampled the batch from and report
    their own logprobs under (``rollout.types.RolloutBatch.temperature``). With
    ``with_entropy``, also that distribution's entropy per position; it keeps no
    graph unless ``entropy_grad``.

    ``positions`` [B, T-1] (bool or 0/1): the next-token positions to score (the
    loss mask); the others are 0. None: every real token's. Only these positions
    reach the output layer: hidden states at them go through ``training.logprobs``
    in chunks, so no [B, T, V] tensor exists in forward or backward (5 GB of fp32
    per 8k tokens at Qwen's vocabulary). A model whose output layer is not a plain
    linear map (megatron's view, logit soft-capping) takes the full-logits path.

    ``packed``: run the right-padded rows as one row of their real tokens
    (``pack_rows``) and give the result back in the padded layout, 0 on padding.
    Same values as the padded forward up to float rounding. ``kernel``: the
    softmax maths of ``training.logprobs`` (``pick_kernel``)."""
    if temperature <= 0:
        raise ValueError(
            f"token logprobs at temperature {temperature}: a greedy batch has no sampling "
            "distribution to train on; train on batches sampled at a temperature > 0"
        )
    real = attention_mask[:, 1:].bool()
    wanted = real if positions is None else positions.bool() & real
    if packed:
        flat, pos_ids, keep = pack_rows(input_ids, attention_mask)
        # Row-major boolean indexing walks the padded targets in the packed order.
        select = torch.zeros_like(keep)
        select[keep] = wanted[real]
        select = select.unsqueeze(0)  # [1, N-1]: the packed row's positions
        kwargs = {"input_ids": flat, "position_ids": pos_ids}
        targets = flat[:, 1:]
    else:
        select = wanted
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        targets = input_ids[:, 1:]
    # The positions as flat indices, found once: each boolean index below would be a
    # host sync of its own (a device's nonzero), in forward and again in backward.
    at = flat_positions(select)
    where = at if not packed else flat_positions(wanted)
    stats = partial(
        _selected_stats,
        at=at,
        targets=targets.reshape(-1).index_select(0, at),
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        kernel=kernel,
    )
    head = _plain_output_layer(model)
    if head is None:
        logits = model(**kwargs, use_cache=False).logits
        lp, ent = stats(logits, None)
    else:
        with _output_layer_replaced(head, lambda hidden: stats(hidden, head.weight)):
            lp, ent = model(**kwargs, use_cache=False).logits
    return _scatter(lp, where, wanted.shape), (
        None if ent is None else _scatter(ent, where, wanted.shape)
    )


def flat_positions(mask: torch.Tensor) -> torch.Tensor:
    """The True positions of ``mask`` [B, L] as indices into its row-major flattening
    (the order boolean indexing walks); one host sync, for their count."""
    return mask.reshape(-1).nonzero().squeeze(1)


def _selected_stats(
    out: torch.Tensor,
    weight: torch.Tensor | None,
    at: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    kernel: Kernel,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stats at next-token positions ``at`` (``flat_positions`` of a [B, L-1] mask) of
    ``out`` [B, L, H or V]: hidden states through ``weight`` (chunked), or logits when
    ``weight`` is None."""
    span = out.shape[1] - 1  # next-token positions per row: position t of row b is
    rows = out.flatten(0, 1).index_select(0, at + at // span)  # row b*L + t of out
    if weight is None:
        logp = torch.log_softmax(rows.float() / temperature, dim=-1)
        lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = -(logp.exp() * logp).sum(-1)
        return lp, entropy
    return token_stats(
        rows, weight, targets, temperature, with_entropy, entropy_grad, kernel=kernel
    )


def _plain_output_layer(model: nn.Module) -> nn.Linear | None:
    """The model's output layer when the logits are exactly ``hidden @ weight.T``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    config = getattr(model, "config", None)
    softcap = getattr(config, "final_logit_softcapping", None)
    if not isinstance(head, nn.Linear) or head.bias is not None or softcap:
        return None
    return head


@contextmanager
def _output_layer_replaced(head: nn.Linear, forward: Callable) -> Iterator[None]:
    """Run ``forward`` in place of the output layer for one model call. It runs inside
    the model's own forward, so FSDP2 has the layer's weight gathered (and in the
    compute dtype) exactly as it would be for the logits."""
    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def _scatter(values: torch.Tensor, where: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Values at flat positions ``where`` back in the padded layout ``shape`` [B, T-1],
    0 elsewhere."""
    return values.new_zeros(shape.numel()).index_copy(0, where, values).view(shape)


def pack_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows [B, T] as one row [1, N] of their tokens, with position ids
    [1, N] restarting at 0 per sample, and ``keep`` [N-1]: the packed next-token
    positions that stay inside one sample (a sample's last token must not predict
    the next sample's first).

    HF's mask builder (``transformers.masking_utils``) reads restarting position
    ids with no attention mask and no KV cache (``use_cache=False``) as packed
    samples and builds the block-diagonal causal mask itself, for sdpa and eager
    attention alike."""
    lengths = attention_mask.sum(dim=1)
    flat = input_ids[attention_mask.bool()].unsqueeze(0)
    positions = torch.cat([torch.arange(int(n), device=input_ids.device) for n in lengths])
    keep = torch.ones(flat.shape[1], dtype=torch.bool, device=input_ids.device)
    keep[torch.cumsum(lengths, 0) - 1] = False  # each sample's last token
    return flat, positions.unsqueeze(0), keep[:-1]


def full_model_state(
    model: nn.Module, device: bool = False, trained_only: bool = False
) -> dict[str, torch.Tensor]:
    """Full CPU state dict on rank 0 ({} elsewhere). Collective: call on every rank.
    ``device``: an unsharded model's own tensors where they live, nothing copied.
    ``trained_only``: leave out the parameters nothing trains (a LoRA model's base)."""
    options = FULL if device else FULL_OFFLOADED
    if trained_only:
        options = replace(options, ignore_frozen_params=True)
    return get_model_state_dict(model, options=options)


def frozen_names(model: nn.Module) -> set[str]:
    """State-dict names of the parameters nothing trains (tied names included)."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def is_sharded(model: nn.Module) -> bool:
    """Whether the model's parameters are FSDP shards (DTensors)."""
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def iter_full_tensors(model: nn.Module):
    """(name, full tensor) of every state-dict entry, on the model's device, one at a
    time. Collective under FSDP2 (each DTensor is all-gathered): iterate it on every
    rank, in the same order."""
    for name, t in model.state_dict().items():
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        yield name, t.detach()


def full_optim_state(model: nn.Module, optim: torch.optim.Optimizer, device: bool = False) -> dict:
    """Full CPU optimizer state keyed by FQN on rank 0 ({} elsewhere). Collective.
    ``device``: an unsharded model's, its own tensors where they live."""
    return get_optimizer_state_dict(model, optim, options=FULL if device else FULL_OFFLOADED)


def load_full_state(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    model_sd: dict[str, torch.Tensor],
    optim_sd: dict,
    strict: bool = True,
) -> None:
    """Load full state dicts that every rank holds; each rank keeps its own shard.
    ``strict=False``: ``model_sd`` may leave out parameters (a LoRA model's frozen base)."""
    set_model_state_dict(model, model_sd, options=replace(FULL, strict=strict))
    set_optimizer_state_dict(model, optim, optim_sd, options=FULL)


def move_state(model: nn.Module, optim: torch.optim.Optimizer, device: torch.device) -> None:
    """Move parameters and optimizer state to ``device`` (offload/onload)."""
    model.to(device)
    for state in optim.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device)
