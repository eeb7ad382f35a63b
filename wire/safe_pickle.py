"""Unpickling of weight-update handles through an allow-list.

Owns the only place where the engines unpickle bytes that came from outside
the process: the base64 bucket handles of ``/update_weights_from_tensor`` and
the CUDA IPC tensor pickles inside a handle. ``find_class`` resolves only the
globals a flattened bucket is made of (``wire.flat_bucket.TensorMeta``, the
CUDA tensor rebuild function and the torch types and dtypes it is called
with); anything else, ``os.system``, ``subprocess``, ``builtins.eval`` or
``getattr`` included, is refused before it is looked up. The same idea as
SGLang's ``SafeUnpickler``; its code is not used.

Must never widen the list to whole modules: one callable from ``os`` or
``builtins`` is enough to run code.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

# dtypes a bucket can carry; torch pickles a dtype as the global torch.<name>.
_DTYPES = frozenset(
    {
        "float32",
        "float16",
        "bfloat16",
        "float64",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
    }
)

ALLOWED: dict[str, frozenset[str]] = {
    "wire.flat_bucket": frozenset({"TensorMeta"}),
    # What ForkingPickler writes for a CUDA tensor (torch.multiprocessing.reductions).
    "torch.multiprocessing.reductions": frozenset({"rebuild_cuda_tensor"}),
    "torch": frozenset({"Tensor", "Size", *_DTYPES}),
    "torch.storage": frozenset({"TypedStorage", "UntypedStorage"}),
    "torch.nn.parameter": frozenset({"Parameter"}),
}


class UnsafePickleError(ValueError):
    """The bytes are not a bucket handle: they name a global outside the allow-list."""


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name not in ALLOWED.get(module, ()):
            raise UnsafePickleError(
                f"refused to unpickle {module}.{name}: a weight-update handle may only hold "
                "TensorMeta and CUDA tensor handles (wire.safe_pickle.ALLOWED)"
            )
        return super().find_class(module, name)


def safe_loads(data: bytes, what: str = "handle") -> Any:
    """``pickle.loads`` through the allow-list; UnsafePickleError names what was refused."""
    try:
        return _AllowListUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError:
        raise
    except Exception as e:  # truncated or garbled bytes: a bad request, not a crash
        raise UnsafePickleError(f"{what} is not a valid pickle: {type(e).__name__}: {e}") from e
