"""Tensor push into real SGLang: this project's payload beside the seed's, one server.

The seed (slime) pushes weights into SGLang from another CUDA process with
SGLang's own classes: ``FlattenedTensorBucket`` of the named tensors, then
``MultiprocessingSerializer.serialize(..., output_str=True)`` of
``{"flattened_tensor", "metadata"}``, posted to ``/update_weights_from_tensor``
with ``load_format: flattened_bucket``. That baseline runs here as written, in
a child process on SGLang's own environment (``--sglang SITE``), against the
same server this process pushes to with ``wire.sglang_payload`` (no SGLang
import). Both hold the same bf16 state on the GPU; the pushes alternate in
rounds so drift hits both alike; a device copy of the same bytes is the floor.
Neither side goes through Ray here: the trainer's push adds one actor call.

    python -m bench.sglang_push --sglang /tmp/sgl --repeats 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from engines.config import EngineConfig, SGLangConfig
from engines.sglang.engine import SGLangEngine
from wire.flat_bucket import flatten
from wire.sglang_payload import tensor_payload

ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--disable-cuda-graph"]

# The seed's push, in SGLang's environment: argv = model dir, url, repeats, first version.
SEED_PUSH = r"""
import json, os, sys, time
import requests, torch
from safetensors.torch import load_file
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

model, url, repeats, first = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
monkey_patch_torch_reductions()
state = {k: v.cuda() for k, v in load_file(f"{model}/model.safetensors").items()}
key = os.environ.get("SGLANG_API_KEY")
headers = {"Authorization": f"Bearer {key}"} if key else {}
times = []
for i in range(repeats):
    t0 = time.perf_counter()
    bucket = FlattenedTensorBucket(named_tensors=list(state.items()))
    payload = MultiprocessingSerializer.serialize(
        {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()},
        output_str=True,
    )
    body = {"serialized_named_tensors": [payload], "load_format": "flattened_bucket",
            "flush_cache": False, "weight_version": str(first + i)}
    r = requests.post(f"{url}/update_weights_from_tensor", json=body, headers=headers, timeout=120)
    r.raise_for_status()
    assert r.json()["success"], r.text
    times.append(time.perf_counter() - t0)
print(json.dumps(times))
"""


def ours(engine: SGLangEngine, state: dict[str, torch.Tensor], repeats: int, first: int) -> list:
    """This project's push of the whole state as one payload (``wire.sglang_payload``)."""
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        flats = flatten(state.items())  # no sync: the IPC handle carries an event to wait on
        reply = engine.update_weights_from_tensor(
            [tensor_payload(flats)], flush_cache=False, weight_version=str(first + i)
        )
        assert reply["success"], reply
        times.append(time.perf_counter() - t0)
        del flats
    return times


def seed(site: str, model: Path, url: str, key: str | None, repeats: int, first: int) -> list:
    env = dict(os.environ, PYTHONPATH=site, SGLANG_API_KEY=key or "")
    out = subprocess.run(
        [sys.executable, "-c", SEED_PUSH, str(model), url, str(repeats), str(first)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        raise RuntimeError(f"the seed's push failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def device_copy(nbytes: int, repeats: int) -> list:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sglang", required=True, help="SGLang's own site folder")
    ap.add_argument("--model", default="", help="HF folder (default: the 0.5B shape, built)")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/sglang_push.json")
    a = ap.parse_args()
    if a.model:
        model = Path(a.model)
    else:
        from training.qwen2_shape import write_qwen2_05b

        model = Path(write_qwen2_05b(Path(tempfile.mkdtemp()) / "qwen2-0.5b"))
    sc = SGLangConfig(pythonpath=[a.sglang], extra_args=ARGS, mem_fraction_static=0.4)
    engine = SGLangEngine(str(model), 0, EngineConfig(kind="sglang", sglang=sc))
    try:
        state = {k: v.cuda() for k, v in load_file(f"{model}/model.safetensors").items()}
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        key = os.environ.get(engine._cfg.api_key_env) if engine._cfg.api_key_env else None
        mine, theirs, version = [], [], 1
        for _ in range(a.rounds):  # alternate, so drift in the server hits both
            mine += ours(engine, state, a.repeats, version)[1:]  # the first: set-up
            version += a.repeats
            theirs += seed(a.sglang, model, engine.url, key, a.repeats, version)[1:]
            version += a.repeats
        copy = device_copy(nbytes, a.repeats)[1:]
        served = engine.get_weight_version()
    finally:
        engine.stop()
    med = {k: statistics.median(v) * 1e3 for k, v in (("ours", mine), ("seed", theirs))}
    copy_ms = statistics.median(copy) * 1e3
    result = {
        "device": torch.cuda.get_device_name(),
        "model": str(model),
        "gb": nbytes / 1e9,
        "buckets": 1,
        "ours_ms": mine_ms(mine),
        "seed_ms": mine_ms(theirs),
        "median_ours_ms": med["ours"],
        "median_seed_ms": med["seed"],
        "ours_over_seed": med["ours"] / med["seed"],
        "device_copy_ms": copy_ms,
        "served_version_after": served,
    }
    print(
        f"| push of {nbytes / 1e9:.2f} GB bf16 into SGLang | ours {med['ours']:.1f} ms | "
        f"seed's {med['seed']:.1f} ms | ours/seed {result['ours_over_seed']:.2f}x | "
        f"device copy {copy_ms:.2f} ms |"
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))


def mine_ms(times: list) -> list:
    return [round(t * 1e3, 2) for t in times]


if __name__ == "__main__":
    main()
