"""Weight transports: seconds per update and GB/s of ``tensor`` (shared memory /
CUDA IPC), ``distributed`` (gloo / NCCL broadcast) and ``disk`` (export +
update_weights_from_disk), against memcpy (CPU) or a device copy (GPU) of the
same bytes, measured in the same run. The ``tensor`` rows are the resident path
(staging buffer registered once, handles cached by the engine) after two warm-up
pushes; ``first s`` is the first push (it streams and learns the layout).

One train actor and one embedded engine actor on the local Ray cluster hold a
Llama model of about ``--size-mb`` MB (float32; bf16 with --dtype bfloat16).

    .venv/bin/python -m bench.transport --sizes 100 1000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def write_model(out: Path, size_mb: int, dtype: str) -> Path:
    """An HF Llama dir of about size_mb MB: 1024-wide layers (~50 MB each in fp32),
    256-wide ones (~3 MB) below 100 MB."""
    import torch
    from transformers import LlamaForCausalLM

    from training.tiny_model import build_tokenizer, tiny_llama_config

    tok = build_tokenizer()
    cfg = tiny_llama_config(len(tok))
    bytes_per = 2 if dtype == "bfloat16" else 4
    hidden, ffn = (1024, 2816) if size_mb >= 100 else (256, 704)  # small sizes: narrow layers
    per_layer = (4 * hidden * hidden + 3 * hidden * ffn) * bytes_per
    cfg.hidden_size, cfg.intermediate_size = hidden, ffn
    cfg.num_attention_heads = cfg.num_key_value_heads = 16
    cfg.num_hidden_layers = max(1, round(size_mb * 1e6 / per_layer))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def cached_model(size_mb: int, dtype: str) -> Path:
    """``write_model`` once per (size, dtype) under the temp folder: the profile and
    the bench of one session share it."""
    out = Path(tempfile.gettempdir()) / "prefect-rl-bench-models" / f"{size_mb}mb-{dtype}"
    if not (out / "config.json").exists():
        write_model(out, size_mb, dtype)
    return out


def device_copy_s(nbytes: int, cuda: bool, repeats: int) -> float:
    import torch

    dev = "cuda" if cuda else "cpu"
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def bench_size(
    size_mb: int, repeats: int, gpus: float, dtype: str, bucket_mb: int, transports: list[str]
) -> list[dict]:
    import ray

    from engines.config import EngineConfig
    from engines.group import EngineGroup
    from storage.config import StorageConfig
    from training.config import (
        ModelConfig,
        RunIdentity,
        TrainConfig,
        TrainerSections,
        WeightsConfig,
    )
    from training.group import TrainGroup

    base = Path(tempfile.mkdtemp(prefix="bench-transport-"))
    model_dir = cached_model(size_mb, dtype)
    run = f"bench-transport-{uuid.uuid4().hex[:6]}"
    storage = StorageConfig(root=str(base / "runs"))
    sections = TrainerSections(
        train=TrainConfig(num_gpus_per_worker=gpus),
        model=ModelConfig(dtype=dtype),
        storage=storage,
        weights=WeightsConfig(),
    )
    trainer = TrainGroup(
        RunIdentity(name=run, seed=0, namespace="prefect-rl"), sections, placement=None, fence=None
    )
    engines = EngineGroup(run, EngineConfig(num_gpus_per_engine=gpus, health_timeout_s=300))
    rows = []
    try:
        trainer.create(str(model_dir))
        engines.start(str(model_dir))
        engine = engines.handle(0)
        bucket = bucket_mb * 1024 * 1024
        times: dict[str, list[float]] = {t: [] for t in transports}
        inside: dict[str, list[float]] = {t: [] for t in transports}  # the trainer's own push
        paths: dict[str, str] = {}
        nbytes = 0
        # Each transport's rounds run back to back, as pushes follow pushes in a run: a
        # disk reload between them would leave the engine fresh tensors, and every copy
        # would pay their first-touch page faults. The first two rounds warm up: the
        # first push streams and learns the layout, the second makes the staging buffer
        # and opens it on the engine (IPC set-up).
        for transport in [t for t in transports if t != "disk"]:
            for _ in range(repeats + 2):
                t0 = time.perf_counter()
                out = trainer.push_weights(engine, transport, bucket, flush_cache=False)
                times[transport].append(time.perf_counter() - t0)
                inside[transport].append(out["s"])
                path = out.get("path", "broadcast")
                nbytes, paths[transport] = (
                    out["bytes"],
                    f"{path}/{out['signal']}" if "signal" in out else path,
                )
        if "disk" in transports:
            from storage.run_store import RunStore

            for r in range(1, repeats + 2):  # round 0 would be the export's warm-up
                t0 = time.perf_counter()
                trainer.export_hf(r + 1, 0, None)
                path = RunStore(storage, run).local_version_dir(r + 1)
                reply = ray.get(engine.update_weights_from_disk.remote(path, str(r + 1)))
                assert reply["success"], reply
                times["disk"].append(time.perf_counter() - t0)
            paths["disk"] = "export+reload"
        copy_s = device_copy_s(nbytes, gpus > 0, repeats)
        for transport, ts in times.items():
            s = statistics.median(ts[-repeats:])
            push_s = statistics.median(inside[transport][-repeats:]) if inside[transport] else s
            rows.append(
                {
                    "size_mb": round(nbytes / 1e6),
                    "dtype": dtype,
                    "device": "cuda" if gpus > 0 else "cpu",
                    "transport": transport,
                    "path": paths[transport],
                    "s_per_update": s,
                    "first_s": ts[0],
                    "GB_per_s": nbytes / s / 1e9,
                    "copy_s": copy_s,
                    "copy_ratio": copy_s / s,
                    "push_s": push_s,  # inside the train actor: what the transport itself costs
                    "push_copy_ratio": copy_s / push_s,
                }
            )
    finally:
        trainer.shutdown()
        engines.shutdown()
    return rows


def table(rows: list[dict]) -> str:
    """s/update: the driver's whole call (driver -> train actor -> engine); push s: the
    train actor's own push (what the transport costs; ``disk``: export + reload).
    copy/x: a same-run device copy (on CPU, torch's copy with the driver's threads,
    where an engine actor copies with one) of the bytes over that time (1.0 = as fast
    as one copy; the issue's goal is >= 0.3 for the push)."""
    head = (
        "| MB | dtype | device | transport | path | s/update | push s | first s | GB/s (push) "
        "| copy s | copy/update | copy/push |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    return head + "".join(
        f"| {r['size_mb']} | {r['dtype']} | {r['device']} | {r['transport']} | {r['path']} | "
        f"{r['s_per_update']:.4f} | {r['push_s']:.4f} | {r['first_s']:.3f} | "
        f"{r['size_mb'] / 1e3 / r['push_s']:.1f} | {r['copy_s']:.4f} | {r['copy_ratio']:.2f} | "
        f"{r['push_copy_ratio']:.2f} |\n"
        for r in rows
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[100])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--gpus", type=float, default=0.0, help="num_gpus of each actor (0.4: share one GPU)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--out", default="bench/results/transport.json")
    ap.add_argument(
        "--transports",
        nargs="+",
        default=["tensor", "distributed", "disk"],
        help="NCCL needs two GPUs: leave 'distributed' out when actors share one",
    )
    args = ap.parse_args()

    import ray
    import torch

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_gpus=torch.cuda.device_count() if args.gpus else 0,
            include_dashboard=False,
            namespace="prefect-rl",
        )
    rows = [
        r
        for size in args.sizes
        for r in bench_size(
            size, args.repeats, args.gpus, args.dtype, args.bucket_mb, args.transports
        )
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()
