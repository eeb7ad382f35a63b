"""Benchmark: trainer checkpoint save against a raw write + fsync of the same bytes.

A Llama of about ``--size-mb`` MB (weights) with AdamW state (two moments, so
about 3x the weights in all) lives on the device (CUDA with --cuda, else CPU).
A save as a train rank makes it (``training.checkpoint.snapshot`` into the
rank's reused host buffers, then ``training.checkpoint.write``) writes
``checkpoints/iter_k`` through the run store (safetensors for the model and the
optimizer shards, sha256 while writing,
fsync, COMMIT last). The baseline writes the same number of bytes per file
with plain 1 MiB writes, every file at once (as ours), fsync each file and the folder
(``bench.weights_io.raw_write``): no device copy, no serialisation, no hashing.
Each op deletes its own previous output first (untimed), and the two are
interleaved (a, b, a, b) after one untimed round.

    python -m bench.checkpoint_save --size-mb 1000 --repeats 3 --cuda

Prints one markdown table; writes bench/results/checkpoint_save.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from bench.transport import cached_model
from bench.weights_io import paired, raw_write


def build(size_mb: int, dtype: str, device: torch.device):
    from transformers import AutoModelForCausalLM

    path = cached_model(size_mb, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for p in model.parameters():  # the moments exist after the first step
        p.grad = torch.zeros_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def bench_size(size: int, args: argparse.Namespace, device: torch.device, base: Path) -> dict:
    from storage import RunStore, StorageConfig
    from training import checkpoint
    from training.host_staging import HostStaging

    model, optim = build(size, args.dtype, device)
    store = RunStore(StorageConfig(root=str(base / "runs")), f"ckpt-{uuid.uuid4().hex[:6]}")
    k = [0]

    def clear_runs() -> None:  # outside the timing, as bench.weights_io does
        shutil.rmtree(base / "runs", ignore_errors=True)

    phases: dict[str, list[float]] = {"snapshot_s": [], "write_s": []}
    staging = HostStaging()  # as a train actor keeps one across its saves

    def save() -> None:  # checkpoint.save, its two phases timed apart
        k[0] += 1
        t0 = time.perf_counter()
        snap = checkpoint.snapshot(model, optim, 0, copy=False, staging=staging)
        t1 = time.perf_counter()
        checkpoint.write(store, k[0], snap, {"iteration": k[0]})
        phases["snapshot_s"].append(t1 - t0)
        phases["write_s"].append(time.perf_counter() - t1)

    save()  # once, to learn the file sizes
    ck = next((base / "runs").rglob("COMMIT")).parent
    sizes = {p.name: p.stat().st_size for p in ck.iterdir() if p.name != "COMMIT"}
    rng = np.random.default_rng(0)
    blobs = {n: [rng.integers(0, 255, size=s, dtype=np.uint8)] for n, s in sizes.items()}
    raw_dir = base / "raw"

    def clear_raw() -> None:
        shutil.rmtree(raw_dir, ignore_errors=True)

    def raw() -> None:
        raw_write(str(raw_dir), blobs, concurrency=len(blobs))  # as checkpoint.write_files

    t_raw, t_ours = paired([raw, save], args.repeats, [clear_raw, clear_runs])
    r_s = statistics.median(w for w, _ in t_raw)
    o_s = statistics.median(w for w, _ in t_ours)
    return {
        "size_mb": size,
        "bytes": sum(sizes.values()),
        "device": device.type,
        "raw_write_fsync_s": r_s,
        "save_s": o_s,
        "raw_over_save": r_s / o_s,
        # where a save goes: the gather to host memory, then serialise + hash + write + fsync
        **{name: statistics.median(v[1:]) for name, v in phases.items()},
        "files": sizes,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, nargs="+", default=[100])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    ap.add_argument("--out", default="bench/results/checkpoint_save.json")
    args = ap.parse_args()

    device = torch.device("cuda" if args.cuda else "cpu")
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-ckpt-"))
    rows = [bench_size(size, args, device, base) for size in args.size_mb]
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(
        "| weights MB | checkpoint MB | device | raw write+fsync s | save s | raw/save "
        "| snapshot s | write s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['size_mb']} | {r['bytes'] / 1e6:.0f} | {r['device']} | "
            f"{r['raw_write_fsync_s']:.3f} | {r['save_s']:.3f} | {r['raw_over_save']:.2f} | "
            f"{r['snapshot_s']:.3f} | {r['write_s']:.3f} |"
        )


if __name__ == "__main__":
    main()
