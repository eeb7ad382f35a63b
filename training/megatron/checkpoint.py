"""Megatron-backend checkpoints in the run store (same commit rule as ``training.checkpoint``).

File set of ``checkpoints/iter_k`` (a ``snapshot`` gathered by every rank,
written by global rank 0 with ``training.checkpoint.write``, at once or in the
background like the torch backend's, COMMIT last):

- ``model.safetensors``: the full model in **HF names** (TP shards gathered and
  converted back). Conversion is exact, so this is the same file the torch
  backend writes, and restoring under another TP size re-splits it.
- the optimizer state (``training.optim_file``): ``{"tensor_parallel": tp, "ranks":
  [AdamW state_dict of TP rank 0, 1, ...]}`` from data-parallel replica 0 (the other
  replicas hold the same state). The optimizer state is per TP shard, so a
  restore needs the same ``tensor_parallel``.
- ``rng.pt``: torch/python/CUDA RNG (``training.checkpoint.rng_state``) plus
  megatron's model-parallel CUDA RNG tracker states.

Never decides which checkpoint to restore; the train group does.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist

from training.checkpoint import (
    MODEL_FILE,
    RNG_FILE,
    detached,
    read_optim,
    rng_state,
    set_rng_state,
)
from training.megatron.model import full_hf_state, load_hf_state


def _tp() -> tuple[int, int, int]:
    """(tp size, tp rank, dp rank) of this process."""
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_data_parallel_rank(),
    )


def _tracker_states() -> dict:
    if not torch.cuda.is_available():
        return {}
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker().get_states()


def snapshot(gpt: torch.nn.Module, optim: torch.optim.Optimizer, copy: bool) -> dict | None:
    """Collective: what checkpoint files hold (``training.checkpoint.write`` writes
    them), gathered on global rank 0 (None elsewhere). ``copy``: no tensor shares
    memory with the live model or optimizer, so training goes on while it is
    written in the background. The RNG states are taken now."""
    tp, tp_rank, dp_rank = _tp()
    model_sd = full_hf_state(gpt, tp)
    optim_sd = optim.state_dict()
    if dist.get_world_size() > 1:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (dp_rank, tp_rank, optim_sd if dp_rank == 0 else None))
        per_tp = {r: sd for d, r, sd in every if d == 0}
        optim_ranks = [per_tp[r] for r in range(tp)]
    else:
        optim_ranks = [optim_sd]
    if dist.get_rank() != 0:
        return None
    snap = {
        "model": model_sd,
        "optim": {"tensor_parallel": tp, "ranks": optim_ranks},
        "rng": {**rng_state(), "megatron_cuda_tracker": _tracker_states()},
    }
    return detached(snap, gpt, optim) if copy else snap


def meta_extra() -> dict[str, Any]:
    """What a megatron checkpoint's meta adds: the backend and the TP size its
    optimizer state is split by (a restore needs the same)."""
    return {"backend": "megatron", "tensor_parallel": _tp()[0]}


def load(store: Any, k: int, gpt: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    """Load checkpoint ``k`` into this rank's model shard and optimizer; returns its meta."""
    import safetensors.torch

    tp, tp_rank, _ = _tp()
    meta = store.read_checkpoint_meta(k)
    with store.open_checkpoint_file(k, MODEL_FILE) as f:
        load_hf_state(gpt, safetensors.torch.load(f.read()), tp, tp_rank)
    optim_sd = read_optim(store, k)
    if not isinstance(optim_sd, dict) or "ranks" not in optim_sd:
        raise ValueError(
            f"checkpoint {k} was not written by the megatron backend; resume it with "
            "train.backend: torch (train.backend is fixed for a run)"
        )
    if optim_sd["tensor_parallel"] != tp:
        raise ValueError(
            f"checkpoint {k} has optimizer state for tensor_parallel={optim_sd['tensor_parallel']}; "
            f"resume with train.megatron.tensor_parallel: {optim_sd['tensor_parallel']}"
        )
    optim.load_state_dict(optim_sd["ranks"][tp_rank])
    with store.open_checkpoint_file(k, RNG_FILE) as f:
        rng = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=False)
    set_rng_state(rng)
    if rng.get("megatron_cuda_tracker") and torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(rng["megatron_cuda_tracker"])
    return meta
