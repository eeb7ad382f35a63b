"""Small builders shared by the storage tests."""

from __future__ import annotations

import random

from storage import RunStore, WeightsManifest


def payload(seed: int, n: int) -> bytes:
    """Deterministic pseudo-random bytes (distinct per seed)."""
    return random.Random(seed).randbytes(n)


def publish(
    store: RunStore, version: int, files: dict[str, bytes] | None = None
) -> WeightsManifest:
    files = files if files is not None else default_files(version)
    w = store.weights_writer(version, iteration=version, parent=version - 1 if version else None)
    for name, data in files.items():
        with w.open(name) as f:
            f.write(data)
    return w.commit()


def default_files(version: int) -> dict[str, bytes]:
    return {
        "model.safetensors": payload(version, 300_000),
        "config.json": b'{"model_type": "llama", "v": %d}' % version,
        "tokenizer/tokenizer.json": b"{}",
    }
