"""What an SGLang engine checks before its server loads a folder from disk.

SGLang 0.5.17's ``/update_weights_from_disk`` loads whatever tensors a folder
holds and answers success: a folder that misses a tensor leaves the old value
of that tensor in place, so the server serves a mix of two versions under the
new version's name (seen on the H100 with the contract test's broken folder).
The engine therefore compares the folder's safetensors headers (names and
shapes, never dtypes: a trainer may publish fp32 of a bf16 start) with those
of the folder it started from, and refuses a folder that lacks a tensor or
changes a shape. Headers only: the bytes are checked against the manifest by
the pull that put the folder there (``storage.pull``).
"""

from __future__ import annotations

import json
import os
import struct

_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def tensor_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    """Every tensor of the ``*.safetensors`` files in ``folder``, by name: its shape.
    Raises ValueError naming the file when a header cannot be read."""
    shapes: dict[str, tuple[int, ...]] = {}
    names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"{folder} holds no *.safetensors file")
    for name in names:
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            if not 0 < n <= _MAX_HEADER:
                raise ValueError(f"{path}: not a safetensors file (header length {n})")
            try:
                header = json.loads(f.read(n))
                for key, info in header.items():
                    if key != "__metadata__":
                        shapes[key] = tuple(int(d) for d in info["shape"])
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}: unreadable safetensors header ({e})") from None
    return shapes


def start_shapes(folder: str) -> dict[str, tuple[int, ...]] | None:
    """The tensors reloads are checked against: those of the folder the server starts
    from; None when it holds no safetensors (a ``.bin`` checkpoint SGLang reads
    itself: its reloads go unchecked)."""
    if not any(n.endswith(".safetensors") for n in os.listdir(folder)):
        return None
    return tensor_shapes(folder)


def refusal(folder: str, start: dict[str, tuple[int, ...]] | None) -> str | None:
    """Why the server must not load ``folder`` (None: it may): tensors of the start
    folder that it lacks, or holds in another shape."""
    if start is None:
        return None
    try:
        got = tensor_shapes(folder)
    except (OSError, ValueError) as e:
        return f"cannot read the weights of {folder}: {e}"
    missing = sorted(set(start) - set(got))
    reshaped = sorted(k for k in start if k in got and got[k] != start[k])
    if not missing and not reshaped:
        return None
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    if reshaped:
        k = reshaped[0]
        parts.append(f"{len(reshaped)} tensor(s) of another shape, e.g. {k} {got[k]} != {start[k]}")
    return (
        f"refused to load {folder}: {'; '.join(parts)} (against the model the engine started "
        "from). SGLang would load the rest and serve a mix of versions; publish the whole "
        "state, or point the reload at a complete folder"
    )
