"""Tensor parallelism for the embedded engine (Llama/Qwen2-family HF models).

Owns how a full HF state dict maps onto ``tp`` ranks, Megatron style:
- column-parallel (``q/k/v_proj``, ``gate/up_proj``): rows of the weight (and
  its bias) split evenly, so each rank holds whole attention heads;
- row-parallel (``o_proj``, ``down_proj``): columns of the weight split; the
  partial outputs are summed by an all-reduce; a bias is kept by rank 0 only
  (zeros elsewhere) so the sum adds it once;
- everything else (embeddings, norms, ``lm_head``) is replicated.
HF's attention infers the local head count from the projection width
(``view(..., -1, head_dim)``), so a sharded HF module runs unchanged.

Also owns the inverse (``gather_state``), used to compare what an engine
serves with a single-rank engine bit for bit. Never decides placement or
versions; the engine does.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from wire.receiver import all_reduce

COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
ROW = frozenset({"o_proj", "down_proj"})

Split = Literal["column", "row", "replicated"]


class TensorParallelError(ValueError):
    """The model cannot be split over the requested number of ranks."""


def split_of(name: str) -> Split:
    """How the parameter ``name`` (``...mlp.up_proj.weight``) is split."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module in COLUMN:
        return "column"
    if module in ROW:
        return "row"
    return "replicated"


def shard_tensor(name: str, t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s part of the full tensor ``name`` (a view where possible)."""
    if tp == 1:
        return t
    split = split_of(name)
    if split == "column":
        return t.chunk(tp, dim=0)[rank]
    if split == "row":
        if t.dim() == 1:  # the bias is added once, by rank 0
            return t if rank == 0 else torch.zeros_like(t)
        return t.chunk(tp, dim=1)[rank]
    return t


def shard_named(
    named: list[tuple[str, torch.Tensor]], rank: int, tp: int
) -> list[tuple[str, torch.Tensor]]:
    return [(n, shard_tensor(n, t, rank, tp)) for n, t in named]


def shard_state(state: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    return {n: shard_tensor(n, t, rank, tp).contiguous() for n, t in state.items()}


def gather_state(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full state from every rank's shard (rank order), inverse of ``shard_state``."""
    out = {}
    for name, first in shards[0].items():
        split = split_of(name)
        if split == "column":
            out[name] = torch.cat([s[name] for s in shards], dim=0)
        elif split == "row" and first.dim() > 1:
            out[name] = torch.cat([s[name] for s in shards], dim=1)
        else:
            out[name] = first
    return out


def check_divisible(config: Any, tp: int) -> None:
    """Heads, KV heads and the MLP width must split evenly over ``tp`` ranks."""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None)
        or config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
    }
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise TensorParallelError(
            f"engines.tp_size={tp} does not divide {bad}; use a tp_size that divides "
            f"{sorted(set(sizes.values()))}"
        )


@torch.no_grad()
def shard_model(model: torch.nn.Module, rank: int, tp: int, group: Any) -> None:
    """Replace the model's parameters with rank ``rank``'s shards, in place, and
    all-reduce the output of every row-parallel module over ``group``."""
    if tp == 1:
        return
    check_divisible(model.config, tp)
    for mod_name, module in model.named_modules():
        leaf = mod_name.rsplit(".", 1)[-1]
        if leaf not in COLUMN and leaf not in ROW:
            continue
        for p_name, p in list(module.named_parameters(recurse=False)):
            shard = shard_tensor(f"{mod_name}.{p_name}", p.data, rank, tp).clone()
            setattr(module, p_name, torch.nn.Parameter(shard, requires_grad=False))
        if leaf in ROW:
            module.register_forward_hook(_all_reduce_hook(group))


def _all_reduce_hook(group: Any):
    def hook(_module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        all_reduce(group, output)
        return output

    return hook
