"""Benchmark: publishing and pulling weight versions vs raw I/O of the same bytes.

For each size: random bf16-sized tensors are written as HF safetensors shards
through ``WeightsWriter`` (hash while writing, shards overlapped, fsync,
manifest, rename) and compared with a plain write + fsync of the identical
shard bytes; ``pull_version`` (verify sha256 while copying into a cache) is
compared with a raw read of those files, and with a raw copy. With ``--s3``
the same is done on a moto S3 server: publish/pull vs raw s3fs put/get of the
same bytes with the same concurrency (16 MiB parts, 8 in flight).

    python bench/weights_io.py --sizes-mb 100 1000 --repeats 3 --s3

Prints one markdown table; writes bench/results/weights_io.json. No assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from storage import RunStore, S3Options, StorageConfig  # noqa: E402
from storage.safetensors_io import (  # noqa: E402
    TensorEntry,
    header_bytes,
    plan_shards,
    shard_names,
    write_hf_shards,
)

MB = 1 << 20
PART = 16 * MB
INFLIGHT = 8
RESULTS = Path(__file__).resolve().parent / "results" / "weights_io.json"


def make_entries(size_mb: int, tensor_mb: int = 16) -> list[TensorEntry]:
    """bf16 tensors (random uint16 payload) summing to ``size_mb`` MiB, plus small ones."""
    rng = np.random.default_rng(0)
    entries: list[TensorEntry] = []
    left = size_mb * MB
    i = 0
    while left > 0:
        nbytes = min(tensor_mb * MB, left)
        n = nbytes // 2
        arr = rng.integers(0, 65535, size=n, dtype=np.uint16)
        entries.append(TensorEntry(f"layers.{i}.weight", "BF16", (n,), memoryview(arr).cast("B")))
        norm = rng.integers(0, 65535, size=1024, dtype=np.uint16)
        entries.append(TensorEntry(f"layers.{i}.norm", "BF16", (1024,), memoryview(norm).cast("B")))
        left -= nbytes
        i += 1
    return entries


def shard_blobs(entries: list[TensorEntry], shard_size: int) -> dict[str, list[memoryview | bytes]]:
    """The exact bytes of each shard file, as pieces (header, tensors...)."""
    plan = plan_shards([e.nbytes for e in entries], shard_size)
    names = shard_names(len(plan))
    out = {}
    for name, idx in zip(names, plan, strict=True):
        es = [entries[i] for i in idx]
        out[name] = [header_bytes(es, {"format": "pt"}), *(e.data for e in es)]
    return out


def timed(
    fn: Callable[[], object], repeats: int, setup: Callable[[], None] | None = None
) -> list[float]:
    out = []
    for _ in range(repeats):
        if setup:
            setup()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def paired(
    fns: list[Callable[[], object]],
    repeats: int,
    setups: list[Callable[[], None] | None] | None = None,
) -> list[list[float]]:
    """Time each fn ``repeats`` times, interleaved (a, b, a, b, ...), so a busy
    machine slows baseline and candidate alike."""
    setups = setups or [None] * len(fns)
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            out[i] += timed(fn, 1, setups[i])
    return out


def raw_write(dirpath: str, blobs: dict[str, list]) -> None:
    os.makedirs(dirpath, exist_ok=True)
    for name, pieces in blobs.items():
        with open(os.path.join(dirpath, name), "wb", buffering=0) as f:
            for p in pieces:
                f.write(p)
            os.fsync(f.fileno())
    fd = os.open(dirpath, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def raw_read(dirpath: str, names: list[str]) -> None:
    buf = bytearray(8 * MB)
    for name in names:
        with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def raw_copy(src: str, dst: str, names: list[str]) -> None:
    os.makedirs(dst)
    for name in names:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


class Bench:
    def __init__(self, store: RunStore, entries: list[TensorEntry], shard_size: int, repeats: int):
        self.store, self.entries, self.shard_size, self.repeats = (
            store,
            entries,
            shard_size,
            repeats,
        )
        self.version = 0

    def publish(self) -> None:
        self.version += 1
        w = self.store.weights_writer(self.version, self.version, None)
        write_hf_shards(w.open, self.entries, self.shard_size, workers=2)
        w.commit()


def bench_disk(size_mb: int, repeats: int, shard_mb: int, base: str) -> list[dict]:
    entries = make_entries(size_mb)
    shard_size = shard_mb * MB
    blobs = shard_blobs(entries, shard_size)
    store = RunStore(StorageConfig(root=os.path.join(base, "runs")), f"disk-{size_mb}")
    b = Bench(store, entries, shard_size, repeats)
    raw_dir = os.path.join(base, "raw")

    def clean_raw() -> None:
        shutil.rmtree(raw_dir, ignore_errors=True)

    t_raw_w, t_pub = paired(
        [lambda: raw_write(raw_dir, blobs), b.publish],
        repeats,
        [clean_raw, lambda: store.gc(keep_last=1) if store.committed_versions() else None],
    )
    v = store.latest_version()
    assert v is not None
    names = [f.name for f in store.read_manifest(v).files]
    vdir = store.local_version_dir(v)
    assert vdir is not None
    raw_read(vdir, names)  # warm the page cache for both readers alike
    caches = os.path.join(base, "cache")
    t_raw_r, t_raw_cp, t_pull = paired(
        [
            lambda: raw_read(vdir, names),
            lambda: raw_copy(vdir, os.path.join(caches, uuid.uuid4().hex), names),
            lambda: store.pull_version(v, os.path.join(caches, uuid.uuid4().hex)),
        ],
        repeats,
    )
    shutil.rmtree(caches, ignore_errors=True)
    clean_raw()
    return [
        row("publish", "disk", size_mb, "raw write+fsync", t_raw_w, t_pub),
        row("pull", "disk", size_mb, "raw read (page cache)", t_raw_r, t_pull),
        row("pull", "disk", size_mb, "raw copy (read+write)", t_raw_cp, t_pull),
    ]


def bench_s3(size_mb: int, repeats: int, shard_mb: int, base: str) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from s3_server import make_bucket, moto_s3

    entries = make_entries(size_mb)
    shard_size = shard_mb * MB
    blobs = {
        n: b"".join(bytes(p) for p in ps) for n, ps in shard_blobs(entries, shard_size).items()
    }
    with moto_s3() as url:
        make_bucket(url, "bench")
        store = RunStore(
            StorageConfig(root="s3://bench/runs", s3=S3Options(endpoint_url=url)), f"s3-{size_mb}"
        )
        fs = store.fs
        b = Bench(store, entries, shard_size, repeats)

        def raw_put() -> None:
            prefix = f"bench/raw/{uuid.uuid4().hex}"
            with ThreadPoolExecutor(2) as pool:  # same shard overlap as write_hf_shards
                for fut in [
                    pool.submit(
                        fs.pipe_file, f"{prefix}/{n}", d, chunksize=PART, max_concurrency=INFLIGHT
                    )
                    for n, d in blobs.items()
                ]:
                    fut.result()
            raw_prefixes.append(prefix)

        raw_prefixes: list[str] = []
        t_raw_put, t_pub = paired(
            [raw_put, b.publish],
            repeats,
            [None, lambda: store.gc(keep_last=1) if store.committed_versions() else None],
        )
        v = store.latest_version()
        assert v is not None
        src = store.version_url(v)
        caches = os.path.join(base, "s3cache")

        def raw_get() -> None:
            d = os.path.join(caches, uuid.uuid4().hex)
            os.makedirs(d)
            for n in blobs:
                fs.get_file(
                    f"{src}/{n}", os.path.join(d, n), chunksize=PART, max_concurrency=INFLIGHT
                )

        t_raw_get, t_pull = paired(
            [
                raw_get,
                lambda: store.pull_version(
                    v, os.path.join(caches, uuid.uuid4().hex), workers=INFLIGHT
                ),
            ],
            repeats,
        )
        shutil.rmtree(caches, ignore_errors=True)
    return [
        row("publish", "moto s3", size_mb, "raw s3fs put", t_raw_put, t_pub),
        row("pull", "moto s3", size_mb, "raw s3fs get", t_raw_get, t_pull),
    ]


def row(
    op: str, where: str, size_mb: int, baseline: str, t_raw: list[float], t_ours: list[float]
) -> dict:
    raw, ours = statistics.median(t_raw), statistics.median(t_ours)
    mb = size_mb * MB / 1e6
    return {
        "op": op,
        "storage": where,
        "size_mb": size_mb,
        "baseline": baseline,
        "raw_s": t_raw,
        "ours_s": t_ours,
        "raw_median_s": raw,
        "ours_median_s": ours,
        "raw_MBps": mb / raw,
        "ours_MBps": mb / ours,
        "ratio": raw / ours,  # ours as a fraction of raw throughput
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| op | storage | MiB | baseline | baseline MB/s | ours MB/s | ours/baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['storage']} | {r['size_mb']} | {r['baseline']} | "
            f"{r['raw_MBps']:.0f} | {r['ours_MBps']:.0f} | {r['ratio']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard-mb", type=int, default=64, help="max shard size (HF default is 5 GB)")
    ap.add_argument("--s3", action="store_true", help="also benchmark a moto S3 server")
    ap.add_argument(
        "--dir", default=None, help="scratch folder on the disk to measure (default: a temp dir)"
    )
    args = ap.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="weights-io-") as base:
        for size in args.sizes_mb:
            rows += bench_disk(size, args.repeats, args.shard_mb, base)
            if args.s3:
                rows += bench_s3(size, args.repeats, args.shard_mb, base)
    print(table(rows))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "cpus": os.cpu_count(),
        "repeats": args.repeats,
        "shard_mb": args.shard_mb,
        "unit": "MB = 1e6 bytes",
    }
    RESULTS.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
