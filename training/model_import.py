"""A GGUF file to an ordinary HF checkpoint that ``model.path`` can name.

Owns the conversion (``import_gguf``) and the check of a GGUF before it is
loaded (``inspect_gguf``: architecture, tensor types, a file cut short). The
weights are read by transformers' own GGUF loader (``from_pretrained(dir,
gguf_file=...)``, which needs the ``gguf`` and ``accelerate`` packages: the
``gguf`` extra); this module fixes what that loader leaves wrong for training
and says what it did in ``prefect-rl-import.json``:

- the loaded model keeps the GGUF quantizer attached, and ``save_pretrained``
  refuses it: it is detached (the weights are already dequantised);
- the weights are rounded to bfloat16 and stored so: many dequantised fp32
  values sit exactly on a bf16 rounding tie, and a run in bf16 that started from
  the fp32 copy would see its first step move them;
- transformers maps the GGUF pre-tokenizer ``smollm`` to plain ByteLevel, which
  splits digits differently from the original tokenizer; ``Digits(individual_
  digits=True)`` is put in front, as in the original;
- ``model_max_length`` comes out unset: it is the GGUF's context length.

A second import of the same file into the same folder is a no-op (the manifest
names the source's sha256). Fetching a packaged GGUF is ``training.model_packages``.
Imports torch and transformers only inside ``import_gguf``; never Prefect or Ray.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "prefect-rl-import.json"
# Dense decoder families whose GGUF transformers reads and the engines and the
# torch trainer load as a plain AutoModelForCausalLM. Only llama is tested here.
ARCHITECTURES = ("llama", "mistral", "qwen2")
# Tensor types read by gguf's own dequantisers (what transformers calls).
QUANTS = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
# GGUF pre-tokenizer names whose transformers mapping drops the original's digit split.
DIGIT_SPLIT_PRE = ("smollm",)


class ModelImportError(ValueError):
    """A GGUF (or package) that cannot be imported; the message names the file and fix."""


@dataclass(frozen=True)
class GGUFInfo:
    path: Path  # the GGUF file
    architecture: str  # general.architecture, e.g. "llama"
    pre_tokenizer: str | None  # tokenizer.ggml.pre, e.g. "smollm"
    context_length: int | None  # {arch}.context_length
    tensor_types: dict[str, int]  # tensor type name -> how many tensors have it


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def inspect_gguf(path: str | Path) -> GGUFInfo:
    """Read a GGUF's header and refuse what ``import_gguf`` cannot convert: not a
    GGUF, a file cut short, an architecture outside ``ARCHITECTURES``, a tensor
    type outside ``QUANTS``. Reads no tensor data."""
    try:
        import gguf
    except ModuleNotFoundError:
        raise ModelImportError(
            "reading a GGUF needs the gguf and accelerate packages: pip install 'prefect-rl[gguf]'"
        ) from None
    p = Path(path)
    if not p.is_file():
        raise ModelImportError(f"{p}: no such file; give the path of a .gguf file")
    size = p.stat().st_size
    try:
        reader = gguf.GGUFReader(p)
    except Exception as e:  # gguf raises ValueError, IndexError, struct errors on a bad header
        raise ModelImportError(
            f"{p}: not a readable GGUF file ({type(e).__name__}: {e}); "
            "it may be cut short or not a GGUF: download it again"
        ) from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise ModelImportError(
            f"{p}: the file is cut short ({size} bytes, its tensors need {end}); download it again"
        )
    arch = str(_field(reader, "general.architecture") or "")
    if arch not in ARCHITECTURES:
        raise ModelImportError(
            f"{p}: architecture {arch!r} is not supported; import-model converts "
            f"{', '.join(ARCHITECTURES)} GGUF files"
        )
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    bad = sorted(set(types) - set(QUANTS))
    if bad:
        raise ModelImportError(
            f"{p}: tensor type(s) {', '.join(bad)} cannot be dequantised; import-model reads "
            f"{', '.join(QUANTS)}: convert from a GGUF quantised with one of those"
        )
    pre = _field(reader, "tokenizer.ggml.pre")
    ctx = _field(reader, f"{arch}.context_length")
    return GGUFInfo(
        p, arch, None if pre is None else str(pre), None if ctx is None else int(ctx), types
    )


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(out: Path) -> dict | None:
    """The import manifest of ``out``, None where there is none (or it is unreadable)."""
    try:
        return json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def import_gguf(path: str | Path, out: str | Path, source: dict | None = None) -> Path:
    """Convert the GGUF at ``path`` into an HF checkpoint folder ``out`` (bf16
    safetensors, config, generation config, tokenizer with its chat template,
    the manifest last). ``source``: how the file was obtained, kept in the
    manifest. A no-op when ``out`` already holds this file's import."""
    p, out = Path(path), Path(out).expanduser()
    done = read_manifest(out)
    # Checked before the header is parsed: reading a vocabulary's fields takes seconds.
    if done is not None and p.is_file() and done.get("source_sha256") == sha256_file(p):
        return out
    info = inspect_gguf(p)
    digest = sha256_file(info.path)
    if out.exists() and any(out.iterdir()):
        what = "the import of another file" if done else "files that are not an import"
        raise ModelImportError(
            f"{out} already holds {what}; give an empty or new folder, or delete it first"
        )
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        fixes = _convert(info, tmp)
        manifest = {
            "format": 1,
            "source_file": info.path.name,
            "source_sha256": digest,
            "source": source or {"kind": "gguf-file", "path": str(info.path.resolve())},
            "architecture": info.architecture,
            "tensor_types": info.tensor_types,
            "dtype": "bfloat16",
            "fixes": fixes,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # last: the commit
        if out.exists():
            out.rmdir()  # empty, checked above
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert(info: GGUFInfo, out: Path) -> list[str]:
    """Load with transformers, apply the fixes, save to ``out``; the fixes applied."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per tensor type is noise in a CLI and CI logs
    folder, name = str(info.path.parent), info.path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, RuntimeError) as e:
        raise ModelImportError(f"{info.path}: transformers cannot load it ({e})") from None
    fixes = []
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # The weights are dequantised already; the quantizer only blocks save_pretrained.
        quantizer.remove_quantization_config(model)
        fixes.append("detached the GGUF quantizer (weights were dequantised on load)")
    model = model.to(torch.bfloat16)
    fixes.append("rounded the dequantised fp32 weights to bfloat16 and stored them so")
    if info.pre_tokenizer in DIGIT_SPLIT_PRE:
        _split_digits(tokenizer)
        fixes.append(
            f"pre-tokenizer {info.pre_tokenizer!r}: Digits(individual_digits=True) before "
            "ByteLevel, as the original tokenizer (transformers maps it to plain ByteLevel)"
        )
    if info.context_length:
        tokenizer.model_max_length = info.context_length
        fixes.append(f"model_max_length = {info.context_length} (the GGUF context length)")
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return fixes


def _split_digits(tokenizer: Any) -> None:
    """Put ``Digits(individual_digits=True)`` in front of the ByteLevel pre-tokenizer."""
    from tokenizers import pre_tokenizers

    backend = tokenizer.backend_tokenizer
    current = backend.pre_tokenizer
    if isinstance(current, pre_tokenizers.Sequence):
        return  # already a sequence: not the plain ByteLevel this fix is for
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), current]
    )
