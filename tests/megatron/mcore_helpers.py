"""Tiny HF Llama / Qwen2 models built in code, for the megatron tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,  # 4 query heads per group: the interleaving matters
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    pad_token_id=0,
)


def tiny_config(family: str, tied: bool = False, **over) -> LlamaConfig | Qwen2Config:
    kw = {**COMMON, "tie_word_embeddings": tied, **over}
    return LlamaConfig(**kw) if family == "llama" else Qwen2Config(**kw)


def tiny_model(family: str, tied: bool = False, seed: int = 0, **over) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = tiny_config(family, tied, **over)
    model = (LlamaForCausalLM if family == "llama" else Qwen2ForCausalLM)(cfg)
    with torch.no_grad():  # HF zero-inits biases and sets norms to 1; make every tensor distinct
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict ``save_pretrained`` would write (tied lm_head dropped)."""
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state
