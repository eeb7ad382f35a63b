"""A Qwen2.5-0.5B-shaped model, random init, built offline (``configs/gpu-0.5b.yaml``).

The shape of Qwen2.5-0.5B (~494M parameters: h896, 24 layers, 14 query and 2
key/value heads, vocab 151936, tied embeddings), saved in bf16 as a normal HF
directory with the tiny character tokenizer (all its ids are below the vocab).
It is not Qwen's weights: it measures what a 0.5B model costs per step, and it
learns the builtin tasks from scratch. Any real checkpoint can be used instead
through ``model.path``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from training.tiny_model import build_tokenizer


def qwen2_05b_config() -> Qwen2Config:
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def write_qwen2_05b(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the model and the tiny tokenizer to ``out_dir`` as an HF directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(qwen2_05b_config(), dtype=torch.bfloat16)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
