"""LoRA adapters on the torch backend: what ``train.lora`` changes in the model.

Owns putting adapters into a loaded HF model, turning them off, and the adapters
a version publishes. ``peft.inject_adapter_in_model`` leaves the model
its own HF class: each target ``nn.Linear`` becomes a LoRA layer around its
frozen base weight (state-dict names ``...q_proj.base_layer.weight``,
``...q_proj.lora_A.default.weight``, ``...lora_B.default.weight``), and only the
adapters require grad, so the optimizer holds only them. The reference model
for KL is the same model with its adapters off (``adapters_disabled``): no
second copy.

A published version and a push hold only the adapters, as peft saves them:
``adapter_state`` takes them out of the adapted model's state dict in peft's names
(``base_model.model.<module>.lora_A.weight``, ``wire.lora``), and
``peft_config`` is the ``adapter_config.json`` beside them. Engines apply them to
the base they keep (W + B @ A * alpha / rank, ``wire.lora.merge``).

Never reads storage or config files, never builds a model.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from training.config import LoraConfig
from wire.lora import peft_key

ADAPTER = "default"  # peft's name for the one adapter a model carries
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
    # The frozen embedding's output needs no gradient, so the first decoder layer's
    # input would not require grad where every later layer's does: compiled layers
    # then recompile per case (and per attention mask, train or eval) until
    # torch.compile's recompile limit sends the rest back to eager. Marked as needing
    # one where gradients are on, every layer sees the same input (HF's
    # enable_input_require_grads does it for checkpointing, in no-grad passes too).
    model.get_input_embeddings().register_forward_hook(_needs_grad)
    return model


def _needs_grad(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
    if torch.is_grad_enabled():
        output.requires_grad_(True)


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


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of an adapted model's ``state`` in peft's saved names (what
    ``get_peft_model_state_dict`` gives), sorted; nothing else of the model."""
    out = {}
    for name, tensor in state.items():
        for which, leaf in (("A", _LORA_A), ("B", _LORA_B)):
            if name.endswith(leaf):
                out[peft_key(name[: -len(leaf)], which)] = tensor
    return dict(sorted(out.items()))


def peft_config(cfg: LoraConfig, base_model_path: str) -> dict[str, Any]:
    """``adapter_config.json`` of ``cfg`` as peft writes it (``LoraConfig.save_pretrained``),
    lists sorted so that the same settings always give the same bytes."""
    from peft import LoraConfig as PeftLoraConfig

    out = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=sorted(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_path,
    ).to_dict()
    # peft keeps target_modules as a set: its order would change with the hash seed
    return {k: sorted(v) if isinstance(v, set) else v for k, v in out.items()}


def config_json(config: dict[str, Any]) -> bytes:
    """The bytes of ``adapter_config.json`` (peft's layout: indent 2, keys sorted)."""
    return json.dumps(config, indent=2, sort_keys=True).encode()
