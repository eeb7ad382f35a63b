"""What a ledger commit costs while a checkpoint streams to the same disk.

A ledger record is a small file written durably (temp file, fsync, rename,
fsync of the folder: ``storage.fs.write_bytes``). A background checkpoint
write puts gigabytes in flight on the same disk. This times the small commit
alone, then again while a writer streams ``--size-mb`` through the project's
``LocalHashingWriter`` (as a checkpoint's files are written) and fsyncs it, and
then while that file is deleted (as retention deletes an old checkpoint).

    python -m bench.ledger_fsync --dir /tmp --size-mb 2300
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time


def commit_seconds(fs, folder: str, n: int, pause_s: float = 0.02) -> list[float]:
    from storage.fs import write_bytes

    out = []
    for i in range(n):
        t0 = time.perf_counter()
        write_bytes(fs, os.path.join(folder, f"rec-{time.time_ns()}-{i}.json"), b'{"ok": true}')
        out.append(time.perf_counter() - t0)
        time.sleep(pause_s)
    return out


def stream(path: str, size_mb: int, done: threading.Event, seconds: list[float]) -> None:
    from storage.hashio import LocalHashingWriter

    block = os.urandom(64 << 20)
    t0 = time.perf_counter()
    with LocalHashingWriter("big", path) as w:
        for _ in range(max(1, size_mb // 64)):
            w.write(block)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    seconds.append(time.perf_counter() - t0)
    done.set()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--size-mb", type=int, default=2300)
    ap.add_argument("--commits", type=int, default=30)
    args = ap.parse_args()
    import fsspec

    fs = fsspec.filesystem("file")
    folder = tempfile.mkdtemp(prefix="ledger-fsync-", dir=args.dir)
    idle = commit_seconds(fs, folder, args.commits)
    done, write_s = threading.Event(), []
    big = os.path.join(folder, "checkpoint.bin")
    writer = threading.Thread(target=stream, args=(big, args.size_mb, done, write_s))
    writer.start()
    busy: list[float] = []
    while not done.is_set():
        busy += commit_seconds(fs, folder, 1)
    writer.join()
    # Retention deletes a checkpoint of that size: commits while it is unlinked (on a
    # filesystem mounted with `discard`, freed extents are trimmed at journal commits).
    done.clear()
    deleter = threading.Thread(target=lambda: (os.remove(big), done.set()))
    t0 = time.perf_counter()
    deleter.start()
    deleting: list[float] = []
    while not done.is_set() or len(deleting) < 10:
        deleting += commit_seconds(fs, folder, 1)
    deleter.join()
    delete_s = time.perf_counter() - t0
    row = {
        "dir": args.dir,
        "size_mb": args.size_mb,
        "idle_median_s": statistics.median(idle),
        "busy_median_s": statistics.median(busy),
        "busy_max_s": max(busy),
        "busy_commits": len(busy),
        "stream_s": write_s[0],
        "deleting_median_s": statistics.median(deleting),
        "deleting_max_s": max(deleting),
        "deleting_sum_s": sum(deleting),
        "delete_s": delete_s,
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
