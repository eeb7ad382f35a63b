"""SGLang's weight wire formats (``wire.sglang_payload``), checked on CPU.

The server unpickles a tensor payload through an allow-list of module prefixes
and views every slice back as its dtype in place; a payload it cannot read
fails the push on the GPU only. Here the same rules are applied on CPU: every
global the payload names is one SGLang's ``SafeUnpickler`` admits (its prefixes,
copied from SGLang 0.5.17's ``sglang/srt/utils/common.py``), and the slices
rebuild bit-exactly, aligned, for buckets of mixed dtypes.
"""

from __future__ import annotations

import base64
import io
import pickle

import pytest
import torch

from flows.config import load_config
from wire import sglang_payload
from wire.flat_bucket import flatten

# The module prefixes SGLang 0.5.17's SafeUnpickler admits that a payload may need.
SGLANG_ALLOWED = ("builtins.", "collections.", "copyreg.", "types.", "torch.", "multiprocessing.")


class AllowListUnpickler(pickle.Unpickler):
    """SGLang's rule: a global loads only from an admitted module prefix; records each."""

    loaded: list[str]

    def find_class(self, module: str, name: str):
        self.loaded = [*getattr(self, "loaded", []), f"{module}.{name}"]
        if not (module + ".").startswith(SGLANG_ALLOWED):
            raise pickle.UnpicklingError(f"{module}.{name} is not on SGLang's allow-list")
        return super().find_class(module, name)


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=g)),  # float32
        ("b.bias", torch.randn(5, generator=g).to(torch.bfloat16)),  # 10 bytes: unaligned next
        ("c.index", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
        ("d.weight", torch.randn(7, generator=g).to(torch.bfloat16)),
    ]


def test_mixed_dtype_bucket_rebuilds_bit_exact_and_aligned():
    named = _named()
    flats = flatten(named)
    flat, meta = sglang_payload.broadcast_flat(flats), sglang_payload.byte_metadata(flats)
    assert flat.dtype == torch.uint8 and flat.numel() == sum(t.nbytes for _, t in named)
    for m in meta:  # each slice can be viewed as its dtype in place (SGLang does)
        assert m.start_idx % torch.empty(0, dtype=m.dtype).element_size() == 0, m.name
        assert m.end_idx - m.start_idx == m.numel
    got = dict(sglang_payload.rebuild(flat, meta))
    for name, t in named:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_one_dtype_bucket_is_a_view_not_a_copy():
    flats = flatten([("x", torch.ones(4)), ("y", torch.zeros(2, 2))])
    assert sglang_payload.broadcast_flat(flats).data_ptr() == flats[0].flat.data_ptr()


def test_payload_names_only_what_sglang_admits_and_round_trips():
    named = _named()
    payload = base64.b64decode(sglang_payload.tensor_payload(flatten(named)), validate=True)
    reader = AllowListUnpickler(io.BytesIO(payload))
    body = reader.load()  # raises on any global SGLang would refuse
    assert {"types.SimpleNamespace", "torch.Size", "torch.bfloat16"} <= set(reader.loaded)
    assert set(body) == {"flattened_tensor", "metadata"}
    got = dict(sglang_payload.rebuild(body["flattened_tensor"], body["metadata"]))
    assert all(torch.equal(got[n], t) for n, t in named)


def test_a_cpu_trainer_cannot_push_tensors_into_sglang():
    from training.weight_sender import _sglang_payload

    with pytest.raises(RuntimeError, match="use weights.transport: disk"):
        _sglang_payload(flatten(_named()), on_gpu=False)
    with pytest.raises(ValueError, match="moves weights from GPU to GPU"):
        load_config(None, {"engines.kind": "sglang", "weights.transport": "tensor"})
