"""LoRA adapters as both sides exchange them: peft's key names, the scale, the merge.

An adapter travels as peft writes it (``save_pretrained``): tensors named
``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight``
[out, r], and a ``LoraConfig`` dict (``r``, ``lora_alpha``, ``use_rslora`` ...).
Served, module ``<module>``'s weight W [out, in] becomes W + scale * (B @ A),
computed in float32 and cast back to W's dtype, exactly as the trainer's peft layers
compute it, so an engine, an export and the trainer hold the same numbers. A
version is served under the adapter name ``v{k}`` (SGLang's ``lora_name``).

Owns naming and arithmetic only: never reads files, never touches a model.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from wire.errors import WeightLoadError
from wire.flat_bucket import FlatBucket, flatten, unflatten

PEFT_PREFIX = "base_model.model."  # what peft's save_pretrained puts before a module path
_KEY_RE = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")
_NAME_RE = re.compile(r"^v(\d+)$")


def adapter_name(version: int) -> str:
    """The name an engine serves adapter version ``version`` under."""
    return f"v{int(version)}"


def version_of(lora_name: str) -> int:
    """The version an adapter name names; ValueError unless it is ``v{k}``."""
    m = _NAME_RE.match(str(lora_name))
    if m is None:
        raise ValueError(f"lora_name {lora_name!r} is not a version name: use 'v{{k}}', e.g. 'v3'")
    return int(m.group(1))


def peft_key(module: str, which: str) -> str:
    """peft's saved name of ``module``'s A or B matrix."""
    return f"{PEFT_PREFIX}{module}.lora_{which}.weight"


def is_adapter_key(name: str) -> bool:
    return _KEY_RE.match(name) is not None


def checksums(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """name -> sha256 of each tensor's bytes (SGLang's ``expected_checksums``)."""
    digests = bucket_checksums(flatten(tensors.items()))
    return {n: digests[n] for n in tensors}


def bucket_checksums(buckets: list[FlatBucket]) -> dict[str, str]:
    """``checksums`` of the tensors in flat ``buckets``, by name. Each bucket reaches
    host memory as one copy: an adapter is hundreds of small tensors, and a
    device-to-host copy of each would wait on the device each time."""
    digests: dict[str, str] = {}
    for bucket in buckets:
        host = FlatBucket(flat=bucket.flat.cpu(), metadata=bucket.metadata)
        for name, t in unflatten(host):
            digests[name] = hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()
    return digests


def check_checksums(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, str]) -> None:
    """WeightLoadError naming the tensors whose bytes are not ``expected``'s (or missing,
    or extra): an adapter that changed on its way is never served."""
    got = checksums(tensors)
    bad = sorted(n for n in set(got) | set(expected) if got.get(n) != expected.get(n))
    if bad:
        raise WeightLoadError(
            f"adapter tensors {bad[:3]} ({len(bad)}) differ from their expected sha256 "
            "(changed, missing or extra on the way); push the version again"
        )


def pairs(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module path -> (A, B) of every adapted module; WeightLoadError naming the key
    for a name that is not peft's or a module that lacks A or B."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _KEY_RE.match(name)
        if m is None:
            raise WeightLoadError(
                f"{name!r} is not a LoRA tensor in peft's names "
                f"({PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)"
            )
        found.setdefault(m.group(1), {})[m.group(2)] = t
    out = {}
    for module, ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise WeightLoadError(f"adapter has lora_{''.join(ab)} of {module!r} but not both")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise WeightLoadError(
                f"{module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                "[r, in] and [out, r]"
            )
        out[module] = (a, b)
    if not out:
        raise WeightLoadError("the adapter holds no tensors")
    return out


def scale(config: Mapping[str, Any]) -> float:
    """peft's scaling of a LoraConfig dict: lora_alpha / r (/ sqrt(r) with use_rslora)."""
    try:
        r, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        raise WeightLoadError(
            "the adapter config needs 'r' and 'lora_alpha' (peft's LoraConfig)"
        ) from None
    if r <= 0:
        raise WeightLoadError(f"the adapter config has r={r}; r must be > 0")
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
    """W + s * (B @ A), in float32, cast to W's dtype (peft's own order of operations)."""
    delta = (b.float() @ a.float()) * s
    return (weight.float() + delta.to(weight.device)).to(weight.dtype)


def merged_weights(
    base: Mapping[str, torch.Tensor],
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
) -> dict[str, torch.Tensor]:
    """HF weight name -> merged weight of every module the adapter changes, from the
    base's weights ``base`` (HF names); WeightLoadError naming a module the base lacks
    or whose shape does not fit. All are computed before any is returned."""
    s = scale(config)
    out = {}
    for module, (a, b) in pairs(tensors).items():
        name = f"{module}.weight"
        w = base.get(name)
        if w is None:
            raise WeightLoadError(
                f"the adapter changes {module!r}, which the model has no {name} of"
            )
        if tuple(w.shape) != (b.shape[0], a.shape[1]):
            raise WeightLoadError(
                f"{module!r}: lora_B @ lora_A is {(b.shape[0], a.shape[1])}, the weight "
                f"{tuple(w.shape)}"
            )
        out[name] = merge(w, a, b, s)
    return out
