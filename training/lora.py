"""LoRA adapters on the torch backend: what ``train.lora`` changes in the model.

Owns putting adapters into a loaded HF model, turning them off, and the merged
weights a version publishes. ``peft.inject_adapter_in_model`` leaves the model
its own HF class: each target ``nn.Linear`` becomes a LoRA layer around its
frozen base weight (state-dict names ``...q_proj.base_layer.weight``,
``...q_proj.lora_A.default.weight``, ``...lora_B.default.weight``), and only the
adapters require grad, so the optimizer holds only them. The reference model
for KL is the same model with its adapters off (``adapters_disabled``): no
second copy.

Engines serve full weights: ``merged_state`` turns a state dict of the adapted
model back into HF names, each target weight W + (B @ A) * alpha / rank, so a
published version, a push and an export look like any full fine-tune's.

Never reads storage or config files, never builds a model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from training.config import LoraConfig

ADAPTER = "default"  # peft's name for the one adapter a model carries
_BASE = ".base_layer."
_LORA_A = f".lora_A.{ADAPTER}.weight"
_LORA_B = f".lora_B.{ADAPTER}.weight"


def linear_names(model: nn.Module) -> list[str]:
    """The last name part of every ``nn.Linear`` in ``model`` (what ``target_modules``
    may name), sorted."""
    return sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    )


def missing_targets(cfg: LoraConfig, model: nn.Module) -> str | None:
    """What is wrong with ``cfg.target_modules`` for ``model`` (a name it has no
    linear layer called), or None."""
    missing = set(cfg.target_modules) - set(linear_names(model))
    if not missing:
        return None
    return (
        f"train.lora.target_modules names {sorted(missing)}, which this model "
        f"({type(model).__name__}) has no linear layer called; its linear layers are "
        f"{linear_names(model)}"
    )


def add_adapters(model: nn.Module, cfg: LoraConfig, seed: int) -> nn.Module:
    """Put ``cfg``'s adapters into ``model`` in place (A drawn from ``seed``, B zero:
    the adapted model starts as the base) and freeze everything else."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    problem = missing_targets(cfg, model)
    if problem:
        raise ValueError(problem)
    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
    )
    # A seed of its own, so the draw is the same on every rank and every rebuild and
    # the run's own random stream is left where it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(peft_cfg, model)
    return model


def lora_layers(model: nn.Module) -> list[nn.Module]:
    """Every LoRA layer of ``model`` (none when it carries no adapters)."""
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` as its base: every adapter off inside the block, back on after."""
    layers = lora_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def merged_state(state: dict[str, torch.Tensor], cfg: LoraConfig) -> dict[str, torch.Tensor]:
    """``state`` of an adapted model in HF names, each adapted weight merged:
    W + (B @ A) * alpha / rank, computed in float32 and cast to W's dtype. A state
    without adapters comes back as it is."""
    scale = cfg.alpha / cfg.rank
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if _LORA_A in name or _LORA_B in name:
            continue
        if _BASE not in name:
            out[name] = tensor
            continue
        layer, leaf = name.split(_BASE)
        hf_name = f"{layer}.{leaf}"
        if leaf != "weight":  # the base layer's bias: unchanged (bias: none)
            out[hf_name] = tensor
            continue
        a, b = state[layer + _LORA_A], state[layer + _LORA_B]
        delta = (b.float() @ a.float()) * scale
        out[hf_name] = (tensor.float() + delta.to(tensor.device)).to(tensor.dtype)
    return out
