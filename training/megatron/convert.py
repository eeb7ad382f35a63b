"""Exact HF <-> megatron-core weight conversion for Llama and Qwen2, and TP split/gather.

Owns the name and layout mapping between an HF ``LlamaForCausalLM`` /
``Qwen2ForCausalLM`` state dict and a megatron-core ``GPTModel`` built with the
local layer spec, plus splitting a full megatron state dict into tensor-parallel
shards and gathering it back. Pure torch: never imports megatron, never touches
a model, storage or a process group, so CI runs its tests without megatron-core.

Every operation is a view, ``cat`` or ``chunk``: HF -> Megatron -> HF returns
the same bytes (no arithmetic, no dtype change).

Layouts (``ng`` query groups = KV heads, ``qpg`` = heads // ng, ``d`` = head dim)::

    linear_qkv.weight  [ng * (qpg + 2) * d, hidden]  per group: q (qpg*d rows), k (d), v (d)
    linear_qkv.bias    [ng * (qpg + 2) * d]           same interleaving (Qwen2 only)
    linear_fc1.weight  [2 * ffn, hidden]              gate rows, then up rows

Under TP, column-parallel tensors (qkv, fc1, embeddings, output layer) split on
dim 0 — qkv by whole query groups, fc1 as gate and up separately — and
row-parallel ones (linear_proj, linear_fc2) on dim 1; norms are replicated.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED = ("llama", "qwen2")
# HF buffers that some checkpoints carry and that are not weights.
IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class ModelSpec:
    """The shapes the conversion needs, read from an HF config."""

    model_type: str  # "llama" | "qwen2"
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int  # = megatron num_query_groups
    head_dim: int  # = megatron kv_channels
    vocab_size: int
    qkv_bias: bool  # Qwen2: True; Llama: attention_bias
    tied: bool  # tie_word_embeddings: no separate output layer

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def spec_from_hf_config(cfg: Any) -> ModelSpec:
    """``ModelSpec`` from a transformers config object or its ``config.json`` dict."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    model_type = get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(
            f"the megatron backend converts {SUPPORTED} models, not {model_type!r}; "
            "use train.backend: torch for this model"
        )
    if get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported by the megatron backend; use torch")
    if model_type == "llama" and get("attention_bias", False):
        raise ValueError("Llama attention_bias=True (o_proj bias) is not supported; use torch")
    heads, hidden = int(get("num_attention_heads")), int(get("hidden_size"))
    kv = int(get("num_key_value_heads") or heads)
    if heads % kv:
        raise ValueError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
        )
    return ModelSpec(
        model_type=model_type,
        num_layers=int(get("num_hidden_layers")),
        hidden_size=hidden,
        ffn_hidden_size=int(get("intermediate_size")),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=int(get("head_dim") or hidden // heads),
        vocab_size=int(get("vocab_size")),
        qkv_bias=model_type == "qwen2" or bool(get("attention_bias", False)),
        tied=bool(get("tie_word_embeddings", False)),
    )


# -- QKV and gate/up fusion -------------------------------------------------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """HF q/k/v (weights [rows, hidden] or biases [rows]) -> megatron's grouped qkv."""
    ng, d = spec.num_kv_heads, spec.head_dim
    tail = q.shape[1:]
    parts = (
        q.reshape(ng, spec.heads_per_group * d, *tail),
        k.reshape(ng, d, *tail),
        v.reshape(ng, d, *tail),
    )
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def split_qkv(
    qkv: torch.Tensor, spec: ModelSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv``: megatron's grouped qkv -> HF q, k, v."""
    ng, d, qpg = spec.num_kv_heads, spec.head_dim, spec.heads_per_group
    tail = qkv.shape[1:]
    grouped = qkv.reshape(ng, (qpg + 2) * d, *tail)
    q, k, v = torch.split(grouped, [qpg * d, d, d], dim=1)
    return (
        q.reshape(-1, *tail).contiguous(),
        k.reshape(-1, *tail).contiguous(),
        v.reshape(-1, *tail).contiguous(),
    )


# -- whole state dicts ------------------------------------------------------
_LAYER_1TO1 = {  # HF suffix -> megatron suffix, within one decoder layer
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_TOP_1TO1 = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
}


def hf_to_megatron(hf: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Full HF state dict -> full (unsplit) megatron ``GPTModel`` state dict.

    ``lm_head.weight`` is dropped when the embeddings are tied (megatron reuses
    the embedding). Raises KeyError naming any HF weight it did not map."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return hf[name]

    for hf_name, m_name in _TOP_1TO1.items():
        out[m_name] = take(hf_name)
    if spec.tied:
        used.add("lm_head.weight")
    else:
        out["output_layer.weight"] = take("lm_head.weight")
    for i in range(spec.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hs, ms in _LAYER_1TO1.items():
            out[m + ms] = take(h + hs)
        attn = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            take(attn + "q_proj.weight"),
            take(attn + "k_proj.weight"),
            take(attn + "v_proj.weight"),
            spec,
        )
        if spec.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(
                take(attn + "q_proj.bias"),
                take(attn + "k_proj.bias"),
                take(attn + "v_proj.bias"),
                spec,
            )
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [take(h + "mlp.gate_proj.weight"), take(h + "mlp.up_proj.weight")], dim=0
        )
    left = sorted(n for n in hf if n not in used and not IGNORED_HF.match(n))
    if left:
        raise KeyError(f"HF weights with no megatron mapping: {left[:8]}")
    return out


def _layer_to_hf(i: int, m: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """One decoder layer: megatron suffixes (``self_attention.linear_qkv.weight``) -> HF names."""
    h, out = f"model.layers.{i}.", {}
    for hs, ms in _LAYER_1TO1.items():
        out[h + hs] = m[ms]
    q, k, v = split_qkv(m["self_attention.linear_qkv.weight"], spec)
    out.update({h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k})
    out[h + "self_attn.v_proj.weight"] = v
    if spec.qkv_bias:
        q, k, v = split_qkv(m["self_attention.linear_qkv.bias"], spec)
        out.update({h + "self_attn.q_proj.bias": q, h + "self_attn.k_proj.bias": k})
        out[h + "self_attn.v_proj.bias"] = v
    gate, up = m["mlp.linear_fc1.weight"].chunk(2, dim=0)
    out[h + "mlp.gate_proj.weight"] = gate.contiguous()
    out[h + "mlp.up_proj.weight"] = up.contiguous()
    return out


def megatron_to_hf(m: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Full megatron state dict -> HF state dict (no ``lm_head`` when tied, as
    ``save_pretrained`` writes it). ``_extra_state`` entries are skipped."""
    return dict(stream_megatron_to_hf(m.items(), spec))


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_TOP_TO_HF = {m: h for h, m in _TOP_1TO1.items()}


def stream_megatron_to_hf(
    items: Iterable[tuple[str, Any]], spec: ModelSpec
) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron (name, tensor) pairs in the model's order -> HF (name, tensor) pairs,
    one decoder layer at a time, so a push never holds more than one converted
    layer. Non-tensors (``_extra_state``) are skipped; ``output_layer`` is dropped
    when the embeddings are tied. The order is: embeddings, layers, norm, lm_head."""
    layer, held = None, {}
    pending_top: list[tuple[str, torch.Tensor]] = []
    for name, t in items:
        if not isinstance(t, torch.Tensor) or name.endswith("_extra_state"):
            continue
        match = _LAYER.match(name)
        idx = int(match.group(1)) if match else None
        if layer is not None and idx != layer:
            yield from _layer_to_hf(layer, held, spec).items()
            layer, held = None, {}
        if match:
            layer = idx
            held[match.group(2)] = t
        elif name in _TOP_TO_HF:
            pending_top.append((_TOP_TO_HF[name], t))
            if name.startswith("embedding."):  # before the layers, as HF orders it
                yield pending_top.pop()
        elif name == "output_layer.weight":
            if not spec.tied:
                pending_top.append(("lm_head.weight", t))
        else:
            raise KeyError(f"megatron weight {name!r} has no HF mapping")
    if layer is not None:
        yield from _layer_to_hf(layer, held, spec).items()
    yield from pending_top


# -- tensor parallelism -----------------------------------------------------
_COLUMN = re.compile(
    r".*(linear_qkv\.(weight|bias)|linear_fc1\.weight|word_embeddings\.weight|output_layer\.weight)$"
)
_ROW = re.compile(r".*(linear_proj\.weight|linear_fc2\.weight)$")
_FC1 = re.compile(r".*linear_fc1\.weight$")


def tp_dim(name: str) -> int | None:
    """Dim that TP splits ``name`` on: 0 (column-parallel), 1 (row-parallel), None (replicated)."""
    if _COLUMN.match(name):
        return 0
    if _ROW.match(name):
        return 1
    return None


def check_tp(spec: ModelSpec, tp: int) -> None:
    """Raise ValueError, naming the fix, when ``spec`` cannot be split ``tp`` ways."""
    for what, n in (
        ("num_key_value_heads", spec.num_kv_heads),
        ("intermediate_size", spec.ffn_hidden_size),
        ("vocab_size", spec.vocab_size),
    ):
        if n % tp:
            raise ValueError(
                f"{what}={n} does not split over tensor_parallel={tp}; "
                f"set train.megatron.tensor_parallel to a divisor of {n}"
            )


def split_tp(state: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    """Full megatron state dict -> ``tp`` per-rank shards (contiguous tensors)."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, t in state.items():
        dim = tp_dim(name)
        if dim is None:
            parts = [t] * tp
        elif _FC1.match(name):  # gate and up are split separately, then re-joined per rank
            gate, up = t.chunk(2, dim=0)
            parts = [torch.cat(gu, dim=0) for gu in zip(gate.chunk(tp, 0), up.chunk(tp, 0))]
        else:
            if t.shape[dim] % tp:
                raise ValueError(f"{name} {tuple(t.shape)} does not split {tp} ways on dim {dim}")
            parts = list(t.chunk(tp, dim=dim))
        for r in range(tp):
            shards[r][name] = parts[r].contiguous()
    return shards


def gather_tp(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of ``split_tp``: per-rank shards (same names on every rank) -> full state."""
    out: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        dim = tp_dim(name)
        if dim is None or len(parts) == 1:
            out[name] = parts[0]
        elif _FC1.match(name):
            halves = [p.chunk(2, dim=0) for p in parts]
            gate = torch.cat([h[0] for h in halves], dim=0)
            up = torch.cat([h[1] for h in halves], dim=0)
            out[name] = torch.cat([gate, up], dim=0)
        else:
            out[name] = torch.cat(parts, dim=dim)
    return out
