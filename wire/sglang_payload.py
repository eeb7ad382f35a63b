"""SGLang's in-memory weight formats, built without importing SGLang.

SGLang's server runs in its own environment (its transformers and pydantic pins
differ from the trainer's), so the trainer cannot import ``sglang``. What the
server reads is plain data, and this module writes it:

- ``/update_weights_from_tensor`` with ``load_format: flattened_bucket``: one
  base64 string per TP rank, each a ``ForkingPickler`` pickle of
  ``{"flattened_tensor": uint8 [nbytes], "metadata": [m, ...]}``, each ``m``
  with ``name, shape, dtype, start_idx, end_idx, numel`` counted in bytes of
  the flat tensor (SGLang's ``FlattenedTensorBucket``, which views each slice
  back as ``dtype`` and ``shape``). The server unpickles through an allow-list
  (torch, builtins, ``types`` ...): the metadata are ``types.SimpleNamespace``
  and the CUDA tensor travels as a CUDA IPC handle whose device is the GPU's
  UUID, which the server maps to its own device index, so the two processes
  need not number their GPUs alike.
- ``/update_weights_from_distributed`` with ``load_format: flattened_bucket``:
  the server allocates that same uint8 layout (tensors in the order named) and
  receives it by one broadcast (``broadcast_flat``).

A bucket of several dtypes is one uint8 tensor (a copy) with the dtypes in
falling element size, so every slice starts aligned for its dtype's view (SGLang
views slices in place); a bucket of one dtype is a view (no copy). Pure torch; the producer keeps the tensors alive
until the server has answered.
"""

from __future__ import annotations

import base64
import io
import types
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from wire.flat_bucket import FlatBucket, to_dtype

# The argument of torch's CUDA tensor reduction that holds the device index.
_DEVICE_ARG = 6


def ordered(flats: list[FlatBucket]) -> list[FlatBucket]:
    """The dtypes of a bucket in falling element size: 8-, 4-, 2-, then 1-byte slices
    each start at a multiple of their size."""
    return sorted(flats, key=lambda b: -b.flat.element_size())


def broadcast_flat(flats: list[FlatBucket]) -> torch.Tensor:
    """The bucket as one uint8 tensor in ``byte_metadata`` order (SGLang's layout)."""
    parts = [b.flat.contiguous().view(torch.uint8) for b in ordered(flats)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def byte_metadata(flats: list[FlatBucket]) -> list[types.SimpleNamespace]:
    """SGLang's ``FlattenedTensorMetadata`` fields, in bytes of ``broadcast_flat``."""
    out, base = [], 0
    for b in ordered(flats):
        size = b.flat.element_size()
        for m in b.metadata:
            start = base + m.start * size
            out.append(
                types.SimpleNamespace(
                    name=m.name,
                    shape=torch.Size(m.shape),
                    dtype=to_dtype(m.dtype),
                    start_idx=start,
                    end_idx=start + m.numel * size,
                    numel=m.numel * size,
                )
            )
        base += b.flat.numel() * size
    return out


def rebuild(flat: torch.Tensor, metadata: list[Any]) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a payload, as SGLang's ``reconstruct_tensors`` views them."""
    return [
        (m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata
    ]


class _Pickler(ForkingPickler):
    """ForkingPickler whose CUDA tensors name their device by UUID (SGLang maps it back)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            from torch.multiprocessing import reductions

            fn, args = reductions.reduce_tensor(obj)
            device = args[_DEVICE_ARG]
            if isinstance(device, int):
                uuid = str(torch.cuda.get_device_properties(device).uuid)
                args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1 :])
            return fn, args
        return NotImplemented


def tensor_payload(flats: list[FlatBucket]) -> str:
    """One TP rank's ``serialized_named_tensors`` entry for ``flats`` (base64 text)."""
    import torch.multiprocessing  # noqa: F401  (registers the tensor reductions)

    body = {"flattened_tensor": broadcast_flat(flats), "metadata": byte_metadata(flats)}
    buf = io.BytesIO()
    _Pickler(buf).dump(body)
    return base64.b64encode(buf.getvalue()).decode("ascii")
