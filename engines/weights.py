"""Checking a state dict against an already-built model, and copying it in.

Owns the all-or-nothing rule of a weight reload: every tensor is read and
checked (names, shapes) before the first parameter is touched, so a broken
or mismatched directory leaves the old weights serving. The errors a reload
ends with are ``wire.errors``. Reading the directory (confined, verified against its
manifest) is ``engines.embedded.weight_files``. Never builds a model and never changes
its architecture.
"""

from __future__ import annotations

import json

import torch

from wire.errors import WeightLoadError, WeightPathError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def shard_names(index_json: bytes, where: str) -> list[str]:
    """The shard file names of an HF index, each a plain name inside its directory."""
    try:
        weight_map = json.loads(index_json)["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightLoadError(f"{where} is not an HF index ({type(e).__name__}: {e})") from None
    for name in names:
        if (
            not isinstance(name, str)
            or not name
            or "/" in name
            or "\\" in name
            or name in (".", "..")
        ):
            raise WeightPathError(
                f"{where} names shard {name!r}: shards must be plain file names inside the "
                "model directory (no absolute paths, no '..', no sub-folders)"
            )
    return names


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
