"""Reading an HF safetensors directory into an already-built model.

Owns the all-or-nothing rule of a weight reload: every tensor is read and
checked (names, shapes) before the first parameter is touched, so a broken
or mismatched directory leaves the old weights serving. Never builds a model
and never changes its architecture.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class WeightLoadError(ValueError):
    """The directory cannot be loaded into this model; the model is untouched."""


def shard_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of an HF dir: sharded (index) or single."""
    root = Path(model_dir)
    index = root / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [root / name for name in sorted(set(weight_map.values()))]
    if (root / SINGLE_NAME).exists():
        return [root / SINGLE_NAME]
    raise WeightLoadError(f"{root} has neither {INDEX_NAME} nor {SINGLE_NAME}")


def read_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the directory, on CPU."""
    state: dict[str, torch.Tensor] = {}
    for path in shard_files(model_dir):
        if not path.exists():
            raise WeightLoadError(f"shard {path.name} listed in the index is missing")
        try:
            state.update(load_file(str(path), device="cpu"))
        except Exception as e:  # safetensors raises its own error types
            raise WeightLoadError(f"cannot read {path.name}: {e}") from e
    return state


def _tied_names(model: torch.nn.Module) -> set[str]:
    """Parameter names that share storage with an earlier-named parameter.

    Checkpoints of tied models omit e.g. ``lm_head.weight``; strict loading
    must not call that missing.
    """
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        ptr = p.data_ptr()
        if ptr in seen:
            tied.add(name)
        else:
            seen[ptr] = name
    return tied


def check_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Raise WeightLoadError unless ``state`` is a strict fit for ``model``."""
    expected = model.state_dict()
    optional = _tied_names(model)
    missing = sorted(set(expected) - set(state) - optional)
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise WeightLoadError(
            f"state dict mismatch: missing {missing[:5]} ({len(missing)}), "
            f"unexpected {unexpected[:5]} ({len(unexpected)})"
        )
    bad = [
        f"{k}: {tuple(v.shape)} != {tuple(expected[k].shape)}"
        for k, v in state.items()
        if v.shape != expected[k].shape
    ]
    if bad:
        raise WeightLoadError(f"shape mismatch: {bad[:5]} ({len(bad)})")


@torch.no_grad()
def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a checked state dict into the model, casting to its dtype/device."""
    check_state_dict(model, state)
    # strict=False only because tied names may be absent; check_state_dict
    # already enforced strictness on everything else.
    model.load_state_dict(state, strict=False)
