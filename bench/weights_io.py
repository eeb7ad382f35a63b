"""Benchmark: publishing and pulling weight versions vs raw I/O of the same bytes.

For each size: random bf16-sized tensors are written as HF safetensors shards
through ``WeightsWriter`` (sha256 and the hash tree while writing, 2 shards at
a time, fsync, manifest, rename) and ``pull_version`` copies them into a cache,
verifying each file's tree on every core (from a local root on the same
filesystem it hard-links, then reads every byte to verify). Baselines, on the same bytes and the same files:

- publish vs "raw write+fsync": write each shard file with plain 1 MiB
  ``write()`` calls (the size ours uses), 2 files at a time (as ours), fsync
  each file, fsync the folder. No hashing, no manifest, no rename.
- pull vs "raw read (page cache)": read every file into one buffer, data cached
  (it was just published) -- the issue's baseline. No hashing, no copy.
- pull vs "raw copy": ``shutil.copyfile`` of every file (in-kernel copy).
- cold rows: the same pull and raw read after the version's pages were evicted
  (fsync + ``POSIX_FADV_DONTNEED``), so both read from the disk: what a pull
  from a root on another disk or a network filesystem looks like.

Each op is timed ``repeats`` times interleaved with its baseline (a, b, a, b)
after one untimed round, and each op first deletes its own previous output.
That matters on VMs with free-page reporting (Firecracker): page-cache memory
the host has reclaimed costs ~5 s/GB of sys time on first touch, while memory
freed a moment ago is still backed. Without this, whichever op happened to
follow a delete ran several times faster than the other.

With ``--s3`` the same is done on a moto S3 server: publish/pull vs raw s3fs
put/get of the same bytes with the same concurrency (16 MiB parts, 8 in flight),
and 4 engines of one node reloading a version at once: each into a cache of its
own (a pull per engine, the baseline) vs into the node's one cache (one pull,
the others wait on its lock). MB/s there is of one version's bytes.

    python -m bench.weights_io --sizes-mb 100 1000 --repeats 3 --s3

Prints one markdown table; writes bench/results/weights_io.json. No assertions.
The last column is this process's CPU seconds per op (all threads, user+sys):
on a shared machine the wall-clock ratio of a CPU-bound op (anything that
hashes) moves with the other tenants' load; its CPU seconds do not.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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

from storage import RunStore, S3Options, StorageConfig, is_local  # noqa: E402
from storage.hashio import write_all  # noqa: E402
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
ENGINES = 4  # engines of one node reloading at once (they share the node's cache)
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


Run = tuple[float, float]  # (wall s, CPU s of this whole process: every thread, user+sys)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn: Callable[[], object], setup: Callable[[], None] | None = None) -> Run:
    if setup:
        setup()
    c, t = _cpu(), time.perf_counter()
    fn()
    return time.perf_counter() - t, _cpu() - c


def paired(
    fns: list[Callable[[], object]],
    repeats: int,
    setups: list[Callable[[], None] | None] | None = None,
) -> list[list[Run]]:
    """Time each fn ``repeats`` times, interleaved (a, b, a, b, ...), so a busy
    machine slows baseline and candidate alike; one untimed round first."""
    setups = setups or [None] * len(fns)
    out: list[list[Run]] = [[] for _ in fns]
    for r in range(repeats + 1):
        for i, fn in enumerate(fns):
            run = timed(fn, setups[i])
            if r:
                out[i].append(run)
    return out


def raw_write(dirpath: str, blobs: dict[str, list], concurrency: int = 2) -> None:
    """Each file: plain writes in 1 MiB syscalls + fsync; ``concurrency`` files at a
    time, as ours (a publish: 2; a checkpoint: every file at once)."""
    os.makedirs(dirpath, exist_ok=True)

    def one(name: str) -> None:
        with open(os.path.join(dirpath, name), "wb", buffering=0) as f:
            for p in blobs[name]:
                write_all(f.fileno(), memoryview(p))
            os.fsync(f.fileno())

    with ThreadPoolExecutor(concurrency) as pool:
        for fut in [pool.submit(one, n) for n in blobs]:
            fut.result()
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


def evict(dirpath: str, names: list[str]) -> None:
    """Drop the files' pages from the page cache (they are clean: fsynced at publish)."""
    for name in names:
        fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Fresh:
    """A scratch folder per call; ``reset`` deletes the previous one first, so the
    op writes into just-freed page cache (see the module docstring)."""

    def __init__(self, base: str):
        self.base, self.path = base, os.path.join(base, uuid.uuid4().hex)

    def reset(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self.path = os.path.join(self.base, uuid.uuid4().hex)


class Bench:
    def __init__(self, store: RunStore, entries: list[TensorEntry], shard_size: int):
        self.store, self.entries, self.shard_size = store, entries, shard_size
        self.version = 0

    def publish(self) -> None:
        self.version += 1
        w = self.store.weights_writer(self.version, self.version, None)
        write_hf_shards(w.open, self.entries, self.shard_size, workers=2)
        w.commit()

    def drop_latest(self) -> None:
        """Delete the previous version (this bench owns the run; gc would keep it)."""
        if self.version and is_local(self.store.fs):
            shutil.rmtree(self.store.version_url(self.version))


def bench_disk(size_mb: int, repeats: int, shard_mb: int, base: str) -> list[dict]:
    entries = make_entries(size_mb)
    shard_size = shard_mb * MB
    blobs = shard_blobs(entries, shard_size)
    store = RunStore(StorageConfig(root=os.path.join(base, "runs")), f"disk-{size_mb}")
    b = Bench(store, entries, shard_size)
    raw = Fresh(os.path.join(base, "raw"))
    t_raw_w, t_pub = paired(
        [lambda: raw_write(raw.path, blobs), b.publish], repeats, [raw.reset, b.drop_latest]
    )
    v = store.latest_version()
    assert v is not None
    names = [f.name for f in store.read_manifest(v).files]
    vdir = store.local_version_dir(v)
    assert vdir is not None
    cp, cache = Fresh(os.path.join(base, "copy")), Fresh(os.path.join(base, "cache"))
    t_raw_r, t_raw_cp, t_pull = paired(
        [
            lambda: raw_read(vdir, names),
            lambda: raw_copy(vdir, cp.path, names),
            lambda: store.pull_version(v, cache.path),
        ],
        repeats,
        [lambda: raw_read(vdir, names), cp.reset, cache.reset],  # both read cached data
    )

    def cold_cache() -> None:
        cache.reset()
        evict(vdir, names)

    t_raw_cold, t_pull_cold = paired(
        [lambda: raw_read(vdir, names), lambda: store.pull_version(v, cache.path)],
        repeats,
        [lambda: evict(vdir, names), cold_cache],
    )
    for d in (raw, cp, cache):
        d.reset()
    return [
        row("publish", "disk", size_mb, "raw write+fsync", t_raw_w, t_pub),
        row("pull", "disk", size_mb, "raw read (page cache)", t_raw_r, t_pull),
        row("pull", "disk", size_mb, "raw copy (sendfile)", t_raw_cp, t_pull),
        row("pull", "disk, cold cache", size_mb, "raw read (cold cache)", t_raw_cold, t_pull_cold),
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
        b = Bench(store, entries, shard_size)

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

        def engines_pull(one_cache: bool) -> None:
            """ENGINES engines of one node reload v at once: a cache each, or the node's."""
            d = os.path.join(caches, uuid.uuid4().hex)
            dirs = [d if one_cache else f"{d}-{e}" for e in range(ENGINES)]
            with ThreadPoolExecutor(ENGINES) as pool:
                list(pool.map(lambda c: store.pull(v, c, workers=INFLIGHT), dirs))

        t_each, t_node = paired([lambda: engines_pull(False), lambda: engines_pull(True)], repeats)
        shutil.rmtree(caches, ignore_errors=True)
    return [
        row("publish", "moto s3", size_mb, "raw s3fs put", t_raw_put, t_pub),
        row("pull", "moto s3", size_mb, "raw s3fs get", t_raw_get, t_pull),
        row(f"pull, {ENGINES} engines", "moto s3", size_mb, "a pull per engine", t_each, t_node),
    ]


def row(op: str, where: str, size_mb: int, baseline: str, raw: list[Run], ours: list[Run]) -> dict:
    med = statistics.median
    t_raw, t_ours = med(w for w, _ in raw), med(w for w, _ in ours)
    mb = size_mb * MB / 1e6
    return {
        "op": op,
        "storage": where,
        "size_mb": size_mb,
        "baseline": baseline,
        "raw_s": [w for w, _ in raw],
        "ours_s": [w for w, _ in ours],
        "raw_median_s": t_raw,
        "ours_median_s": t_ours,
        "raw_cpu_median_s": med(c for _, c in raw),  # process CPU (user+sys, all threads)
        "ours_cpu_median_s": med(c for _, c in ours),
        "raw_MBps": mb / t_raw,
        "ours_MBps": mb / t_ours,
        "ratio": t_raw / t_ours,  # ours as a fraction of raw throughput
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| op | storage | MiB | baseline | baseline MB/s | ours MB/s | ours/baseline "
        "| CPU s baseline / ours |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['storage']} | {r['size_mb']} | {r['baseline']} | "
            f"{r['raw_MBps']:.0f} | {r['ours_MBps']:.0f} | {r['ratio']:.2f}x | "
            f"{r['raw_cpu_median_s']:.2f} / {r['ours_cpu_median_s']:.2f} |"
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
    load_before = os.getloadavg()
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
        "loadavg_before": load_before,  # 1/5/15-min load: the machine is shared
        "loadavg_after": os.getloadavg(),
    }
    RESULTS.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
