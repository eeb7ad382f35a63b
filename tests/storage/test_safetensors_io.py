import io
import json

import numpy as np
import pytest
import safetensors.numpy
from safetensors import safe_open

from storage.errors import StorageError
from storage.safetensors_io import (
    INDEX_NAME,
    TensorEntry,
    plan_shards,
    shard_names,
    write_hf_shards,
    write_safetensors,
)


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "a.weight": rng.standard_normal((3, 5)).astype(np.float32),
        "b.bias": rng.standard_normal((7,)).astype(np.float16),
        "c.ids": np.arange(6, dtype=np.int64).reshape(2, 3),
        "scalar": np.array(2.5, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


_CODES = {np.float32: "F32", np.float16: "F16", np.int64: "I64", np.float64: "F64"}


def _entries(arrs: dict[str, np.ndarray]) -> list[TensorEntry]:
    return [
        TensorEntry(k, _CODES[a.dtype.type], a.shape, memoryview(a).cast("B") if a.size else b"")
        for k, a in arrs.items()
    ]


def test_write_safetensors_reads_back_identically(tmp_path):
    arrs = _arrays()
    path = tmp_path / "m.safetensors"
    with open(path, "wb") as f:
        write_safetensors(f, _entries(arrs), metadata={"format": "pt"})
    back = safetensors.numpy.load_file(str(path))
    assert back.keys() == arrs.keys()
    for k, a in arrs.items():
        assert back[k].dtype == a.dtype and back[k].shape == a.shape
        np.testing.assert_array_equal(back[k], a)
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_len % 8 == 0


def test_bf16_bytes_round_trip():
    raw = np.arange(12, dtype=np.uint16)
    buf = io.BytesIO()
    write_safetensors(buf, [TensorEntry("w", "BF16", (3, 4), raw.tobytes())])
    n = int.from_bytes(buf.getvalue()[:8], "little")
    header = json.loads(buf.getvalue()[8 : 8 + n])
    assert header["w"] == {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 24]}
    assert buf.getvalue()[8 + n :] == raw.tobytes()


def test_wrong_size_and_dtype_are_refused():
    with pytest.raises(StorageError, match="needs 16"):
        write_safetensors(io.BytesIO(), [TensorEntry("w", "F32", (2, 2), b"\0" * 12)])
    with pytest.raises(StorageError, match="unknown safetensors dtype"):
        write_safetensors(io.BytesIO(), [TensorEntry("w", "F33", (1,), b"\0" * 4)])


def test_plan_shards_and_names():
    assert plan_shards([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
    assert plan_shards([], 8) == [[]]
    assert shard_names(1) == ["model.safetensors"]
    assert shard_names(3)[0] == "model-00001-of-00003.safetensors"


def test_write_hf_shards_with_index(tmp_path):
    arrs = {f"layer{i}.w": np.full((64,), i, dtype=np.float32) for i in range(5)}

    def open_file(name):
        return open(tmp_path / name, "wb")

    names = write_hf_shards(open_file, _entries(arrs), shard_size=600)
    assert names[-1] == INDEX_NAME and len(names) == 4
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == 5 * 256
    for k, a in arrs.items():
        got = safetensors.numpy.load_file(str(tmp_path / index["weight_map"][k]))[k]
        np.testing.assert_array_equal(got, a)
