"""Where the time of one CUDA-IPC (or shared-memory) weight push goes, phase by phase.

Two plain Ray actors on one device (a producer holding the trainer's tensors,
a consumer holding an HF Llama model of the same names) run the ``tensor``
transport's steps one at a time, each followed by a device synchronize, so
every phase is timed alone:

- ``streamed`` (the per-bucket path): cut into buckets, flatten each (``torch.cat``),
  make its handle, one Ray call per bucket in which the consumer opens the handle
  and copies into the model.
- ``resident`` (the path a single trainer rank that never sleeps uses): its
  weights are bound into a staging buffer registered once (nothing to fill),
  one Ray call per update whose handle the consumer has cached, and the
  consumer's weights, bound into flats of the same layout, take one device copy
  per dtype.
- ``socket`` (what the resident path does with an embedded engine): the same,
  but the update is one line on the consumer's Unix socket
  (``wire.update_socket``) instead of a Ray call.

Each phase is the median over ``--repeats`` pushes after one warm-up push, beside
a device copy (memcpy on CPU) of the same bytes measured in the same run.

    python -m bench.transport_profile --size-mb 1000 --dtype bfloat16 --gpus 0.4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


class Consumer:
    def __init__(self, model_dir: str, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)
        ).to(self.dev)
        self.cache = None

    def apply_streamed(self, handles: list) -> dict:
        from wire import receiver as wr

        t0 = time.perf_counter()
        named = wr.named_tensors(wr.open_bucket(handles[0], self.dev))
        _sync(self.dev)
        t1 = time.perf_counter()
        wr.copy_into(self.model, named)
        _sync(self.dev)
        t2 = time.perf_counter()
        named.clear()
        return {"open": t1 - t0, "copy": t2 - t1}

    def start_socket(self) -> dict:
        from wire.update_socket import UpdateSocket

        def handler(channel: str, key: str, flush: bool, version: str | None) -> dict:
            part = {"metadata": None}
            return self.apply_resident(
                [{"cache": {"channel": channel, "key": key}, "parts": [part]}]
            )

        self.socket = UpdateSocket(handler)
        return self.socket.address()

    def apply_resident(self, handles: list) -> dict:
        from engines.embedded.weight_cache import ReceiverCache

        self.cache = self.cache or ReceiverCache()
        t0 = time.perf_counter()
        plan = self.cache.plan(self.model, handles[0], self.dev, 0, 1)
        t1 = time.perf_counter()
        plan.copy()
        _sync(self.dev)
        t2 = time.perf_counter()
        return {"open": t1 - t0, "copy": t2 - t1}


class Producer:
    def __init__(self, model_dir: str, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)
        ).to(self.dev)
        self.staging = None

    def named(self) -> list:
        return [(n, t.detach()) for n, t in self.model.state_dict().items()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named())

    def push_streamed(self, consumer, bucket_bytes: int) -> dict:
        import ray

        from training.weight_sender import ShmSegment, _ipc_handle
        from wire.flat_bucket import flatten, iter_buckets

        ph = {"flatten": 0.0, "handle": 0.0, "call": 0.0, "open": 0.0, "copy": 0.0, "free": 0.0}
        nb = 0
        t_all = time.perf_counter()
        for bucket in iter_buckets(self.named(), bucket_bytes):
            nb += 1
            t0 = time.perf_counter()
            flats = flatten(bucket)
            _sync(self.dev)
            t1 = time.perf_counter()
            seg = None
            if self.dev.type == "cuda":
                h = _ipc_handle(flats)
            else:
                seg = ShmSegment(flats)
                h = seg.handle
            t2 = time.perf_counter()
            inner = ray.get(consumer.apply_streamed.remote([h]))
            t3 = time.perf_counter()
            if seg is not None:
                seg.close()
            del flats
            _sync(self.dev)
            t4 = time.perf_counter()
            ph["flatten"] += t1 - t0
            ph["handle"] += t2 - t1
            ph["call"] += t3 - t2 - inner["open"] - inner["copy"]
            ph["open"] += inner["open"]
            ph["copy"] += inner["copy"]
            ph["free"] += t4 - t3
        ph["total"] = time.perf_counter() - t_all
        ph["buckets"] = nb
        return ph

    def push_resident(self, consumer, address: dict | None = None) -> dict:
        import ray

        from training.weight_staging import Layout, Staging
        from wire.update_socket import UpdateClient

        ph = {}
        t0 = time.perf_counter()
        if self.staging is None:
            layout, items = Layout.record(self.named())
            list(items)
            self.staging = Staging(layout, self.dev, "profile")
            self.staging.bind(self.model)  # one rank: its weights become the buffer
        t1 = time.perf_counter()
        if self.staging.bound(self.model):
            self.staging.ready()
        else:
            self.staging.fill(self.named())
        _sync(self.dev)
        t2 = time.perf_counter()
        h = self.staging.handle(full=not self.staging.acked)
        self.staging.acked.add("consumer")
        t3 = time.perf_counter()
        if (
            address is not None
            and "consumer" in self.staging.acked
            and h["parts"][0]["metadata"] is None
        ):
            if getattr(self, "client", None) is None:
                self.client = UpdateClient(address)
            cache = h["cache"]
            inner = self.client.update(cache["channel"], cache["key"], False, None)
        else:
            inner = ray.get(consumer.apply_resident.remote([h]))
        t4 = time.perf_counter()
        ph["build"] = t1 - t0
        ph["fill"] = t2 - t1
        ph["handle"] = t3 - t2
        ph["call"] = t4 - t3 - inner["open"] - inner["copy"]
        ph["open"] = inner["open"]
        ph["copy"] = inner["copy"]
        ph["total"] = t4 - t0
        ph["buckets"] = 1
        return ph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, nargs="+", default=[100])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--gpus", type=float, default=0.0)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--paths", nargs="+", default=["streamed", "resident", "socket"])
    ap.add_argument("--out", default="bench/results/transport_profile.json")
    args = ap.parse_args()

    import ray
    import torch

    from bench.transport import cached_model, device_copy_s

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_gpus=torch.cuda.device_count() if args.gpus else 0,
            include_dashboard=False,
        )
    rows = []
    for size in args.size_mb:
        d = cached_model(size, args.dtype)
        opts = {"num_gpus": args.gpus, "num_cpus": 1}
        prod = ray.remote(Producer).options(**opts).remote(str(d), args.dtype)
        cons = ray.remote(Consumer).options(**opts).remote(str(d), args.dtype)
        nbytes = sum(t.numel() * t.element_size() for t in ray.get(prod.named.remote()) and [])
        address = ray.get(cons.start_socket.remote())
        for path in args.paths:
            runs = []
            for _ in range(args.repeats + 1):
                if path == "streamed":
                    runs.append(ray.get(prod.push_streamed.remote(cons, args.bucket_mb << 20)))
                elif path == "resident":
                    runs.append(ray.get(prod.push_resident.remote(cons)))
                else:  # the warm-up push opened the buffer over Ray, as an engine does
                    runs.append(ray.get(prod.push_resident.remote(cons, address)))
            med = {k: statistics.median(r[k] for r in runs[1:]) for k in runs[0]}
            med["first_total"] = runs[0]["total"]
            rows.append({"size_mb": size, "dtype": args.dtype, "path": path, **med})
        nbytes = ray.get(
            prod.__ray_call__.remote(
                lambda s: sum(t.numel() * t.element_size() for _, t in s.named())
            )
        )
        copy_s = device_copy_s(nbytes, args.gpus > 0, args.repeats)
        for r in rows:
            if r["size_mb"] == size:
                r["bytes"], r["copy_s"] = nbytes, copy_s
                r["x_copy"] = copy_s / r["total"]
        ray.kill(prod)
        ray.kill(cons)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    keys = ["flatten", "build", "fill", "handle", "call", "open", "copy", "free", "total"]
    print(
        "| MB | path | buckets | " + " | ".join(f"{k} ms" for k in keys) + " | copy ms | × copy |"
    )
    print("|---" * (len(keys) + 5) + "|")
    for r in rows:
        cells = " | ".join(f"{r[k] * 1e3:.2f}" if k in r else "-" for k in keys)
        print(
            f"| {r['bytes'] / 1e6:.0f} | {r['path']} | {r['buckets']:.0f} | {cells} | "
            f"{r['copy_s'] * 1e3:.3f} | {r['x_copy']:.3f} |"
        )


if __name__ == "__main__":
    main()
