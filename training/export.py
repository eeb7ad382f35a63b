"""Publish trainer weights through the run store, and export adapter versions.

Owns the HF layout of a published version: safetensors shards bounded by
``shard_size`` (streamed, never built in memory as one blob), the shard index,
tied-weight handling, and the non-weight files (config, tokenizer) copied from
the base model directory; with LoRA, peft's two adapter files instead
(``write_adapter``). ``merge_adapter`` writes an adapter version merged into its
base as a plain HF folder (``prefect-rl materialize``). Never gathers tensors
itself (the caller hands a full state dict in) and never decides when to publish.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
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


def write_adapter(
    writer: Any, state: dict[str, torch.Tensor], config: dict[str, Any]
) -> dict[str, Any]:
    """Write a LoRA adapter version's two files as peft's ``save_pretrained`` does:
    ``state`` (peft names, ``training.lora.adapter_state``) and ``config``
    (``training.lora.peft_config``). Returns what was written; the caller commits."""
    from storage.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from storage.safetensors_io import write_safetensors
    from training.lora import config_json

    entries = [tensor_entry(name, t) for name, t in state.items()]
    with writer.open(ADAPTER_WEIGHTS) as f:
        write_safetensors(f, entries, {"format": "pt"})
    with writer.open(ADAPTER_CONFIG) as f:
        f.write(config_json(config))
    files = [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    return {"shards": 1, "weight_bytes": sum(e.nbytes for e in entries), "files": files}


def manifest_dict(manifest: Any) -> dict[str, Any]:
    """The store's manifest as a plain dict, whatever type the store returns."""
    if isinstance(manifest, dict):
        return manifest
    if dataclasses.is_dataclass(manifest):
        return dataclasses.asdict(manifest)
    if hasattr(manifest, "model_dump"):
        return manifest.model_dump(mode="json")
    return {"manifest": repr(manifest)}


def merge_adapter(store: Any, version: int, dest: str) -> str:
    """Write adapter version ``version`` of ``store`` (a ``RunStore``) merged into its
    base as a new HF folder ``dest``: every adapted weight W + scale * (B @ A)
    (``wire.lora.merge``, as engines serve it), every other file the base's, so plain
    transformers loads it. Both versions are pulled verified first (the adapter's base
    digest checked); the folder appears whole or not at all. Returns ``dest``."""
    import safetensors.torch

    from storage.errors import StorageError
    from storage.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST
    from wire.lora import merged_weights

    adapter = store.read_manifest(version).adapter
    if adapter is None:
        raise ValueError(f"v{version} holds full weights, not an adapter: nothing to merge")
    dest = os.path.abspath(os.path.expanduser(dest))
    if os.path.exists(dest):
        raise StorageError(f"{dest} exists; the export writes a new folder, pick another")
    work = tempfile.mkdtemp(prefix=".tmp-merge-", dir=os.path.dirname(dest) or ".")
    try:
        adapter_dir = store.pull(version, os.path.join(work, "cache")).path
        base_dir = store.pull(adapter.base, os.path.join(work, "cache")).path
        tensors = safetensors.torch.load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
        with open(os.path.join(adapter_dir, ADAPTER_CONFIG), "rb") as f:
            config = json.load(f)
        shards = {
            n: safetensors.torch.load_file(os.path.join(base_dir, n))
            for n in sorted(os.listdir(base_dir))
            if n.endswith(".safetensors")
        }
        every = {name: t for shard in shards.values() for name, t in shard.items()}
        merged = merged_weights(every, tensors, config)
        out = os.path.join(work, "out")
        os.makedirs(out)
        for name in sorted(os.listdir(base_dir)):
            if name == MANIFEST:  # the base's hashes would not hold for merged shards
                continue
            if name in shards:
                shard = {n: merged.get(n, t) for n, t in shards[name].items()}
                safetensors.torch.save_file(shard, os.path.join(out, name), {"format": "pt"})
            else:
                shutil.copyfile(os.path.join(base_dir, name), os.path.join(out, name))
        os.rename(out, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest
