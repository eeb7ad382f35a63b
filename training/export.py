"""Publish trainer weights as an HF directory through the run store.

Owns the HF layout of a published version: safetensors shards bounded by
``shard_size`` (streamed, never built in memory as one blob), the shard index,
tied-weight handling, and the non-weight files (config, tokenizer) copied from
the base model directory. Never gathers tensors itself (the caller hands a full
state dict in) and never decides when to publish.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
# Files of an HF directory that hold weights; everything else is copied as is.
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".safetensors.index.json",
    ".bin.index.json",
)


def tensor_entry(name: str, tensor: torch.Tensor) -> Any:
    """A zero-copy ``TensorEntry`` over the bytes of a CPU tensor."""
    from storage.safetensors_io import TensorEntry

    t = tensor.detach().to("cpu").contiguous()
    data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
    return TensorEntry(
        name=name, dtype=SAFETENSORS_DTYPES[t.dtype], shape=tuple(t.shape), data=data
    )


def drop_tied(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the tied copies (e.g. ``lm_head.weight``) as ``save_pretrained`` does;
    ``from_pretrained`` re-ties them from the source weight."""
    config = model.config
    tied = getattr(config, "tie_word_embeddings", False)
    if hasattr(config, "get_text_config"):
        tied = tied or getattr(config.get_text_config(), "tie_word_embeddings", False)
    if not tied:
        return state
    keys = getattr(model, "_tied_weights_keys", None) or []
    # transformers 5 maps target -> source; 4.x lists the targets.
    targets = list(keys.keys()) if isinstance(keys, dict) else list(keys)
    return {k: v for k, v in state.items() if k not in targets}


def write_hf_weights(
    writer: Any, state: dict[str, torch.Tensor], shard_size: int, base_model_path: str
) -> dict[str, Any]:
    """Stream ``state`` into ``writer`` as HF shards (+ index), then add the
    config/tokenizer files of the base directory. Returns what was written; the
    caller commits."""
    from storage.safetensors_io import write_hf_shards

    entries = [tensor_entry(name, t) for name, t in state.items()]
    files = write_hf_shards(writer.open, entries, shard_size=shard_size)
    for path in sorted(Path(base_model_path).iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            writer.add_file(path.name, str(path))
            files.append(path.name)
    shards = sum(f.endswith(".safetensors") for f in files)
    return {"shards": shards, "weight_bytes": sum(e.nbytes for e in entries), "files": files}


def manifest_dict(manifest: Any) -> dict[str, Any]:
    """The store's manifest as a plain dict, whatever type the store returns."""
    if isinstance(manifest, dict):
        return manifest
    if dataclasses.is_dataclass(manifest):
        return dataclasses.asdict(manifest)
    if hasattr(manifest, "model_dump"):
        return manifest.model_dump(mode="json")
    return {"manifest": repr(manifest)}
