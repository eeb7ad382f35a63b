"""``distributed`` between two GPUs: a train actor on one GPU broadcasts the model
over NCCL to an embedded engine on the other, beside a peer copy of the same
bytes across the two GPUs (``src.to("cuda:1")`` in this process, timed with CUDA
events), measured in the same run. The goal is ours >= 0.5x the peer copy.

Each side asks for a whole GPU (two 1-GPU placement groups on a 2-GPU node, so
Ray puts them on different devices). ``s/update`` is the wall time of one
``push_weights`` from this driver, as ``bench.transport`` measures it (the
trainer call, one engine call per bucket, the broadcasts, the engine's copy
into its weights): the median of ``--repeats`` after two warm-up pushes (the
first builds the NCCL group). One row per size and bucket size.

    python3 -m bench.transport_2gpu --sizes 1000 3000 --dtype bfloat16 --bucket-mb 512 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.transport import bench_size

GOAL = 0.5  # ours / peer copy


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 3000], help="model MB")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--bucket-mb", type=int, nargs="+", default=[512], help="weights.bucket_bytes, in MiB"
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/results/transport_2gpu.json")
    return ap.parse_args(argv)


def check_two_gpus() -> None:
    """Refuse, naming the fix, on a machine with fewer than two CUDA devices."""
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        raise SystemExit(
            f"bench.transport_2gpu needs 2 CUDA GPUs, this machine has {n}: run it on "
            "nvidia-h200-x2 (`bash scripts/gpu2.sh` runs it there), or use bench.transport here"
        )


def peer_copy_s(nbytes: int, repeats: int) -> float:
    """Median seconds of ``src.to("cuda:1")`` for ``nbytes`` of bf16 on cuda:0 (one
    warm-up). The copy runs on the source device's current stream, which the events
    bracket."""
    import torch

    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda:0")
    stream = torch.cuda.current_stream(0)
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        start.record(stream)
        dst = src.to("cuda:1")
        end.record(stream)
        torch.cuda.synchronize(1)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
        del dst
    return statistics.median(times[1:])


def bench(size_mb: int, bucket_mb: int, dtype: str, repeats: int) -> dict:
    import torch

    (row,) = bench_size(size_mb, repeats, 1.0, dtype, bucket_mb, ["distributed"])
    nbytes = round(row["GB_per_s"] * 1e9 * row["s_per_update"])  # what the push moved
    peer = peer_copy_s(nbytes, repeats)
    return {
        **row,
        "bucket_mb": bucket_mb,
        "peer_access": torch.cuda.can_device_access_peer(0, 1),
        "peer_copy_s": peer,
        "peer_GB_per_s": nbytes / peer / 1e9,
        "peer_ratio": peer / row["s_per_update"],
    }


def table(rows: list[dict]) -> str:
    """peer/ours: the same-run peer copy's time over ours (1.0 = as fast as the copy)."""
    head = (
        "| MB | dtype | bucket MiB | s/update | first s | GB/s | peer copy s | peer GB/s "
        f"| peer/ours | goal >= {GOAL} |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    return head + "".join(
        f"| {r['size_mb']} | {r['dtype']} | {r['bucket_mb']} | {r['s_per_update']:.4f} | "
        f"{r['first_s']:.3f} | {r['GB_per_s']:.1f} | {r['peer_copy_s']:.4f} | "
        f"{r['peer_GB_per_s']:.1f} | {r['peer_ratio']:.2f} | "
        f"{'met' if r['peer_ratio'] >= GOAL else 'not met'} |\n"
        for r in rows
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_two_gpus()
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_gpus=2, include_dashboard=False, namespace="prefect-rl")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for bucket in args.bucket_mb:  # every size at the first bucket size first: the default's
        for size in args.sizes:
            rows.append(bench(size, bucket, args.dtype, args.repeats))
            # Kept row by row: a run cut short by its time limit still reports what it measured.
            out.write_text(json.dumps(rows, indent=2))
            print(table(rows[-1:]), flush=True)
    print(table(rows))
    print(f"peer access cuda:0 -> cuda:1: {rows[0]['peer_access']}")


if __name__ == "__main__":
    main()
