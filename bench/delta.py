"""Benchmark: publishing and pulling delta versions (storage.delta) vs full versions.

States (``bench.delta_states``), each published as v0 (full), then v1..vN:
``tiny-f32``/``tiny-bf16`` (the tiny Llama, AdamW steps), ``0.5b`` (the
Qwen2.5-0.5B shape, synthetic lr x N(0, 1) steps) and, with ``--real-steps N``,
``real-lr<lr>``: N real GRPO steps of the project's own trainer on the 0.5B
shape in bf16 (CUDA when there is one, else CPU with tiny batches).

Each path as a run uses it (``training.durable._write_hf``, ``tasks.serving``):

- publish: ``RunStore.weights_writer`` (full: every byte hashed, sha256 and the
  hash tree, written and fsynced; delta: XOR against v0, encoded (``xor-words``),
  the sha256 and tree of the new bytes, the small delta files fsynced), then commit.
- pull: what happens before an engine loads. Local disk, full: nothing (engines
  load the committed folder, ``engine_weights``); local disk, delta: the pull
  that rebuilds and verifies into the engines' cache, which holds v0 already
  (frames decoded on every core, each chunk hashed as it is written or its hash
  carried from v0's tree); S3: a verified pull (delta: rebuilt from the cached v0).
- load: the engine's own check of the folder it loads (``verify_dir``: every
  chunk hashed on every core against the manifest's trees), the same work on both
  sides.

``ratio`` is delta/full of publish + pull; ``ratio+load`` adds the load. The
first delta also pays what is paid once per base (the publisher hashes the
base's files; on S3 it pulls the base): its row shows it. Floors from the same
run, over the last version's bytes: ``sha256`` (one thread, as one file is
hashed), ``write+fsync`` (what a full publish must do), and how many seconds
each takes; and a delta's own work against v0 in CPU seconds (XOR, encode,
decode-and-apply, BLAKE3), beside each row's CPU seconds per step in the JSON.
Each path deletes its own output before its next version (the full path its last
version, the delta path its rebuilt folder), so both write into page cache freed a
moment ago (see ``bench.weights_io`` on first-touch costs of VMs). A full
version's hash, over its committed files on local disk (warm page cache, median
of 5): one sha256 pass per file (how a version was verified before hash trees),
its hash tree (BLAKE3 per 8 MiB chunk on every core, as ``verify_dir`` does it)
and the same chunks hashed with sha256 on every core (the other candidate). Wall
and CPU seconds (this process). No assertions.

``--busy-disk-gb 2.3`` times each local-disk path again while a checkpoint-sized
writer streams to the same disk (a run saving every iteration): the case where
writing 4% of the bytes might buy time on a slow disk. On the 2-core box (fast
disk) it did not: both paths slowed alike, bound by CPU.

    python -m bench.delta --steps 3 --s3
    python -m bench.delta --real-steps 3 --out bench/results/delta_real_cuda.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.delta_states import real_states, synthetic_states, tiny_states  # noqa: E402
from storage import RunStore, S3Options, StorageConfig, tree, verify_dir  # noqa: E402
from storage.delta_format import CODEC, FRAME, XorWords, encode  # noqa: E402
from storage.hashio import hash_file, start_writeback, write_all  # noqa: E402
from storage.safetensors_io import TensorEntry, write_hf_shards  # noqa: E402
from training.config import WeightsConfig  # noqa: E402

MB = 1 << 20
SHARD = WeightsConfig().shard_size  # the default of --shard-mb
SLICE = 16 * MB  # storage.hashio's hash/write slice
RESULTS = Path(__file__).resolve().parent / "results" / "delta_cpu.json"


def timed(fn: Callable[..., object], *args: object, **kw: object) -> tuple[float, float, Any]:
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = fn(*args, **kw)
    t, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return t, cpu, out


def publish(
    store: RunStore,
    v: int,
    entries: list[TensorEntry],
    every: int | None,
    base_cache: str | None = None,
    shard: int = SHARD,
    workers: int | None = None,
):
    w = store.weights_writer(
        v, v, v - 1 if v else None, full_every=every, base_cache_dir=base_cache
    )
    write_hf_shards(w.open, entries, shard_size=shard, workers=workers)
    return w.commit()


def floors(entries: list[TensorEntry], tmp: str) -> dict[str, float]:
    """Seconds of the raw work under each path, over ``entries``' bytes, done as
    storage.hashio does it: sha256 in 16 MiB slices on one thread, and write in
    1 MiB calls with each 16 MiB slice's writeback started at once, then fsync."""
    views = [memoryview(e.data).cast("B") for e in entries]
    slices = [mv[i : i + SLICE] for mv in views for i in range(0, mv.nbytes, SLICE)]
    t0 = time.perf_counter()
    sha = hashlib.sha256()
    for sl in slices:
        sha.update(sl)
    sha_s = time.perf_counter() - t0
    path = os.path.join(tmp, f"floor-{uuid.uuid4().hex[:6]}")
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        off = 0
        for sl in slices:
            write_all(f.fileno(), sl)
            start_writeback(f.fileno(), off, sl.nbytes)
            off += sl.nbytes
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    os.unlink(path)
    return {"sha256_s": round(sha_s, 3), "write_fsync_s": round(write_s, 3)}


def codec_floors(base: list[TensorEntry], new: list[TensorEntry]) -> dict[str, Any]:
    """CPU seconds of a delta's own work over ``new``'s bytes against ``base`` (tensors
    matched by name), one FRAME-sized frame at a time on this thread: the XOR, the
    codec's encode (a publisher's, which spreads a file's frames over every core) and
    decode-and-apply (as a rebuild: the nonzero words XORed into an image), and BLAKE3
    (a tree's chunks). The sha256 and write floors: ``floors``."""
    by_name = {e.name: e for e in base}
    xs = []
    for e in new:
        b = by_name.get(e.name)
        a = np.frombuffer(e.data, np.uint8)
        if b is None or len(b.data) != len(a):
            xs.append(a.copy())
        else:
            xs.append(a ^ np.frombuffer(b.data, np.uint8))
    x = np.concatenate(xs)
    frames = [x[i : i + FRAME] for i in range(0, len(x), FRAME)]
    out = np.empty(FRAME, np.uint8)

    def cpu(fn: Callable[[], object]) -> float:
        # The process's CPU (all its threads); nothing else runs.
        t0 = time.process_time()
        fn()
        return round(time.process_time() - t0, 3)

    packed: list[bytes] = []
    encode_s = cpu(lambda: packed.extend(encode(f) for f in frames))
    scratch, words, jobs = np.empty(FRAME, np.uint8), XorWords(), list(zip(packed, frames))
    return {
        # Two frames in, one out, as a XOR against the base reads (frames[0] is the longest).
        "xor_cpu_s": cpu(
            lambda: [np.bitwise_xor(f, frames[0][: len(f)], out=out[: len(f)]) for f in frames]
        ),
        "codec": CODEC,
        "encode_cpu_s": encode_s,
        "encoded_bytes": sum(len(p) for p in packed),
        # Into reused buffers, as a rebuild does: a fresh one per frame costs page faults.
        "decode_apply_cpu_s": cpu(
            lambda: [words.apply(p, out[: len(f)], scratch, "bench") for p, f in jobs]
        ),
        "blake3_cpu_s": cpu(lambda: [tree.digest(f) for f in frames]),
    }


def hash_floors(folder: str, repeat: int = 5) -> dict[str, float]:
    """Median seconds to hash a committed version's files (see the module doc)."""
    paths = [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n != "manifest.json"]
    local = threading.local()

    def chunk(fd: int, off: int, n: int, fn: Callable[[memoryview], object]) -> None:
        if getattr(local, "buf", None) is None:
            local.buf = bytearray(tree.CHUNK)
        view = memoryview(local.buf)[:n]
        got = 0
        while got < n:
            got += os.preadv(fd, [view[got:]], off + got)
        fn(view)

    def chunks(fn: Callable[[memoryview], object]) -> None:
        fds = [os.open(p, os.O_RDONLY) for p in paths]
        try:
            futs = [
                tree.pool().submit(chunk, fd, off, min(tree.CHUNK, size - off), fn)
                for fd, size in ((fd, os.fstat(fd).st_size) for fd in fds)
                for off in range(0, size, tree.CHUNK)
            ]
            for x in futs:
                x.result()
        finally:
            for fd in fds:
                os.close(fd)

    def med(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return round(statistics.median(times), 4)

    return {
        "sha256_one_pass_s": med(lambda: [hash_file(p) for p in paths]),
        "tree_blake3_s": med(lambda: chunks(tree.digest)),
        "tree_sha256_s": med(lambda: chunks(lambda v: hashlib.sha256(v).digest())),
        "threads": tree.workers(),
    }


@contextmanager
def busy_disk(tmp: str, gb: float) -> Iterator[None]:
    """A checkpoint-sized writer beside the timed block: ``gb`` GB written in 1 MiB
    calls into ``tmp``, then fsynced (a run that saves every iteration writes 2.3 GB of
    checkpoint while it publishes 1 GB: docs/benchmarks.md, bench.ledger_fsync). Joined after the
    block, so each block starts on a quiet disk."""
    if gb <= 0:
        yield
        return
    path = os.path.join(tmp, f"busy-{uuid.uuid4().hex[:6]}")
    chunk = b"\x01" * MB

    def run() -> None:
        with open(path, "wb", buffering=0) as f:
            for _ in range(int(gb * 1024)):
                f.write(chunk)
            os.fsync(f.fileno())

    t = threading.Thread(target=run, name="bench-busy-disk")
    t.start()
    try:
        yield
    finally:
        t.join()
        os.unlink(path)


def run_state(
    name: str,
    versions: list,
    fractions: list,
    cfg_of: Callable[[str], StorageConfig],
    where: str,
    tmp: str,
    busy_gb: float = 0.0,
    hashes: dict | None = None,
    shard: int = SHARD,
    workers: int | None = None,
) -> list[dict]:
    """Rows of one state on one root: full vs delta for v1..vN (see the module doc);
    on a quiet local disk also a full version's hash times, into ``hashes``."""
    hashes = {} if hashes is None else hashes
    steps = len(versions) - 1
    full = RunStore(cfg_of("full"), f"{name}-full-{uuid.uuid4().hex[:6]}")
    delta = RunStore(cfg_of("delta"), f"{name}-delta-{uuid.uuid4().hex[:6]}")
    base_cache = os.path.join(tmp, f"pub-{uuid.uuid4().hex[:6]}")
    publish(full, 0, versions[0], None, shard=shard, workers=workers)
    publish(delta, 0, versions[0], None, shard=shard, workers=workers)
    engine_cache = os.path.join(tmp, f"eng-{uuid.uuid4().hex[:6]}")
    delta.pull(0, engine_cache)  # the engines hold v0 already
    rows = []
    for v in range(1, steps + 1):
        with busy_disk(tmp, busy_gb if where == "disk" else 0):
            tf, cf, mf = timed(publish, full, v, versions[v], None, shard=shard, workers=workers)
            folder, cache = full.local_version_dir(v), None
            tpf = cpf = 0.0
            if folder is None:  # an object store: engines pull; a local root: they load it
                cache = os.path.join(tmp, f"full-{v}-{uuid.uuid4().hex[:6]}")
                tpf, cpf, pulled = timed(full.pull, v, cache)
                folder = pulled.path
            tlf, clf, _ = timed(verify_dir, folder)
        if cache is not None:
            shutil.rmtree(cache)
        with busy_disk(tmp, busy_gb if where == "disk" else 0):
            td, cd, md = timed(
                publish, delta, v, versions[v], steps + 1, base_cache, shard=shard, workers=workers
            )
            assert md.delta is not None and md.rebuilt().file_set() == mf.file_set()
            tpd, cpd, pulled = timed(delta.pull, v, engine_cache)
            tld, cld, _ = timed(verify_dir, pulled.path)
        shutil.rmtree(pulled.path)
        if where == "disk" and v < steps:
            # Each path frees its own output before its next version (the delta path its
            # rebuilt folder, above): on a VM with free-page reporting, page cache freed
            # a moment ago is cheap to write again and memory the host reclaimed costs
            # seconds per GB (bench.weights_io), so neither path may live off the other's.
            shutil.rmtree(full.version_url(v))
        row = {
            "state": name,
            "root": where,
            "busy_disk_gb": busy_gb if where == "disk" else 0,
            "version": v,
            "changed_fraction_vs_prev": round(fractions[v - 1], 6),
            "full_bytes": mf.total_bytes(),
            "delta_bytes": md.total_bytes(),
            "bytes_ratio": round(md.total_bytes() / mf.total_bytes(), 4),
            "full_publish_s": round(tf, 3),
            "full_pull_s": round(tpf, 3),
            "full_load_s": round(tlf, 3),
            "delta_publish_s": round(td, 3),
            "delta_pull_rebuild_s": round(tpd, 3),
            "delta_load_s": round(tld, 3),
            "time_ratio": round((td + tpd) / (tf + tpf), 3),
            "time_ratio_with_load": round((td + tpd + tld) / (tf + tpf + tlf), 3),
            "full_cpu_s": round(cf + cpf + clf, 3),
            "delta_cpu_s": round(cd + cpd + cld, 3),
            # CPU seconds of each step (this process, all its threads)
            "full_publish_cpu_s": round(cf, 3),
            "full_pull_cpu_s": round(cpf, 3),
            "full_load_cpu_s": round(clf, 3),
            "delta_publish_cpu_s": round(cd, 3),
            "delta_pull_rebuild_cpu_s": round(cpd, 3),
            "delta_load_cpu_s": round(cld, 3),
        }
        rows.append(row)
        print(
            f"| {name} | {where}{f' + {busy_gb:g} GB' if busy_gb and where == 'disk' else ''} | v{v} | {row['changed_fraction_vs_prev']:.4f} | "
            f"{mf.total_bytes() / MB:.2f} MB | {md.total_bytes() / MB:.3f} MB ({row['bytes_ratio']:.3f}) | "
            f"{tf:.2f} + {tpf:.2f} + {tlf:.2f} s | {td:.2f} + {tpd:.2f} + {tld:.2f} s | "
            f"{row['time_ratio']:.2f}x | {row['time_ratio_with_load']:.2f}x | "
            f"{row['full_cpu_s']:.2f} / {row['delta_cpu_s']:.2f} |",
            flush=True,
        )
    if where == "disk" and not busy_gb:
        folder = full.local_version_dir(steps)
        assert folder is not None
        hashes.update(hash_floors(folder))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="steps of the tiny and 0.5b states")
    ap.add_argument("--lr", type=float, default=1e-6, help="0.5b state: step size")
    ap.add_argument("--out", default=str(RESULTS), help="results JSON")
    ap.add_argument(
        "--states",
        nargs="*",
        default=None,
        help="of tiny-f32 tiny-bf16 0.5b (default: all three, none with --real-steps)",
    )
    ap.add_argument("--real-steps", type=int, default=0, help="real trainer steps (0: none)")
    ap.add_argument(
        "--real-lrs",
        type=float,
        nargs="+",
        default=[1e-4, 1e-6],
        help="real steps' AdamW lr, one state each (1e-4: configs/gpu-0.5b.yaml)",
    )
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--s3", action="store_true", help="also on a moto S3 server")
    ap.add_argument(
        "--busy-disk-gb",
        type=float,
        default=0.0,
        help="local disk: also time each path while a checkpoint-like writer streams this "
        "many GB to the same disk (2.3: a 0.5B run saving every iteration)",
    )
    ap.add_argument("--shard-mb", type=int, default=SHARD // MB, help="weights.shard_size, in MiB")
    ap.add_argument(
        "--shard-workers",
        type=int,
        default=None,
        help="shards written at once (default: write_hf_shards's, one per core up to 8)",
    )
    args = ap.parse_args()
    names = args.states
    if names is None:
        names = [] if args.real_steps else ["tiny-f32", "tiny-bf16", "0.5b"]
    states: dict[str, tuple[list, list]] = {}
    meta: dict[str, Any] = {
        "steps": args.steps,
        "lr_0.5b": args.lr,
        "shard_mb": args.shard_mb,
        "shard_workers": args.shard_workers,
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    for s in names:
        if s == "0.5b":
            states[s] = synthetic_states(args.steps, args.lr)
        else:
            states[s] = tiny_states(args.steps, "F32" if s == "tiny-f32" else "BF16")
    if args.real_steps:
        import torch

        device = args.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        for lr in args.real_lrs:
            t0 = time.perf_counter()
            versions, fractions, info = real_states(args.real_steps, lr, device)
            info["build_and_train_s"] = round(time.perf_counter() - t0, 1)
            print(f"real-lr{lr:g}: {info}", flush=True)
            states[f"real-lr{lr:g}"] = (versions, fractions)
            meta[f"real-lr{lr:g}"] = info
    print(
        "| state | root | version | changed values | full | delta (ratio) | full publish + pull + load | "
        "delta publish + pull/rebuild + load | ratio | ratio+load | CPU s full / delta |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-delta-") as tmp:
        for s, (versions, fr) in states.items():
            meta[f"floors-{s}"] = {"bytes": sum(len(e.data) for e in versions[-1])}
            meta[f"floors-{s}"] |= floors(versions[-1], tmp)
            meta[f"floors-{s}"] |= codec_floors(versions[0], versions[-1])
            for busy in sorted({0.0, args.busy_disk_gb}):
                rows += run_state(
                    s,
                    versions,
                    fr,
                    lambda kind: StorageConfig(root=os.path.join(tmp, kind)),
                    "disk",
                    tmp,
                    busy,
                    meta[f"floors-{s}"],
                    shard=args.shard_mb * MB,
                    workers=args.shard_workers,
                )
        if args.s3:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from s3_server import make_bucket, moto_s3

            with moto_s3() as url:
                make_bucket(url, "bench")
                for s, (versions, fr) in states.items():
                    rows += run_state(
                        s,
                        versions,
                        fr,
                        lambda kind: StorageConfig(
                            root=f"s3://bench/{kind}", s3=S3Options(endpoint_url=url)
                        ),
                        "moto s3",
                        tmp,
                        shard=args.shard_mb * MB,
                        workers=args.shard_workers,
                    )
    for s in states:
        f = meta[f"floors-{s}"]
        print(
            f"floors {s} ({f['bytes'] / MB:.0f} MB, local disk): sha256 one thread "
            f"{f['sha256_s']:.2f} s, write+fsync {f['write_fsync_s']:.2f} s"
        )
        print(
            f"a delta's own work ({s}, v{args.steps} against v0, one thread, CPU s): XOR "
            f"{f['xor_cpu_s']:.2f}, {f['codec']} encode {f['encode_cpu_s']:.2f} (to "
            f"{f['encoded_bytes'] / f['bytes']:.3f} of the bytes), decode and apply "
            f"{f['decode_apply_cpu_s']:.2f}, BLAKE3 {f['blake3_cpu_s']:.2f}"
        )
        if "tree_blake3_s" in f:
            one = f["sha256_one_pass_s"]
            print(
                f"a full version's hash ({s}, its files, median of 5): sha256 one pass per "
                f"file {one:.3f} s; tree on {f['threads']} threads: BLAKE3 "
                f"{f['tree_blake3_s']:.3f} s ({one / max(f['tree_blake3_s'], 1e-4):.1f}x faster), sha256 "
                f"chunks {f['tree_sha256_s']:.3f} s ({one / max(f['tree_sha256_s'], 1e-4):.1f}x)"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
