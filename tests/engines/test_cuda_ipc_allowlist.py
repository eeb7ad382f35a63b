"""A real CUDA IPC bucket opens through the allow-list unpickler (wire.safe_pickle).

The producer is another process, as the trainer is: it pickles a CUDA tensor
with ForkingPickler (training.weight_sender._ipc_handle's way) and keeps it
alive until the consumer has copied it. Needs CUDA; plain functions so it can
also run as ``python tests/engines/test_cuda_ipc_allowlist.py`` on a machine
without Ray.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from wire import receiver as wr  # noqa: E402
from wire.flat_bucket import TensorMeta  # noqa: E402

pytestmark = pytest.mark.gpu


def _produce(queue, done) -> None:
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the CUDA reductions)

    for dtype in (torch.float32, torch.bfloat16):
        flat = torch.arange(12, device="cuda", dtype=dtype)
        buf = io.BytesIO()
        ForkingPickler(buf).dump(flat)
        queue.put(buf.getvalue())
        done.wait()
        done.clear()


def test_cuda_ipc_bucket_opens_through_the_allow_list() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ctx = torch.multiprocessing.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_produce, args=(queue, done))
    proc.start()
    try:
        for name in ("float32", "bfloat16"):
            meta = [TensorMeta("w", (3, 4), name, 0, 12, 12)]
            handle = {
                "kind": "cuda_ipc",
                "parts": [{"handle": queue.get(timeout=120), "metadata": meta}],
            }
            (bucket,) = wr.open_bucket(handle, torch.device("cuda"))
            got = bucket.flat.float().cpu()
            assert torch.equal(got, torch.arange(12).float()) and bucket.flat.is_cuda
            del bucket
            done.set()
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


if __name__ == "__main__":
    test_cuda_ipc_bucket_opens_through_the_allow_list()
    print("cuda ipc allow-list: ok")
