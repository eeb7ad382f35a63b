"""Soak: the resident memory of every process of a long run, as growth per 1,000
iterations after a warm-up, beside each process's size.

One run of the Prefect flow (``rl_training``, as users run it) on a fresh storage
root under /tmp. A sampler thread reads VmRSS from /proc every ``--interval``
seconds for this process (the flow: Prefect client and Ray driver) and for each of
its descendants, grouped by role: Ray's GCS server, the raylet, Prefect's
temporary server, each actor (by class), Ray's agents and idle workers. With each
sample it counts the committed iterations (the run's ``metrics/`` rows). Growth is
the least-squares slope of a role's RSS against that count over the samples after
``--warmup`` iterations, times 1,000: a straight line is a leak, a flat one a
bounded process.

    .venv/bin/python -m bench.soak --iterations 700

``--census`` also counts the flow process's live Python objects by type at the
end of the warm-up and at the end (``gc.get_objects``), and ``--tracemalloc``
traces allocations from the warm-up on and prints, by source line, what the
flow allocated after it and still holds at the end (it slows the flow).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

KB_MB = 1 / 1024  # VmRSS is in kB
RAY_TITLES = {
    "IDLE": "ray idle worker",
    "DashboardAgent": "ray dashboard agent",
    "RuntimeEnvAgent": "ray runtime-env agent",
}
SCRIPTS = {  # a Python process's script, by a part of its command line
    "ray/dashboard/dashboard.py": "ray dashboard head",
    "ray/autoscaler/_private/monitor.py": "ray autoscaler monitor",
    "tasks/reaper.py": "reaper watcher",
}


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:  # the process ended between the listing and the read
        return None


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (by parent pid, one /proc pass)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _read(f"/proc/{name}/stat")
        if stat:
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def role(pid: int, me: int) -> str | None:
    """What a process is, from its command line (None: it has ended)."""
    raw = _read(f"/proc/{pid}/cmdline")
    if raw is None:
        return None
    argv = [a for a in raw.split("\0") if a]
    if pid == me:
        return "flow (driver)"
    if not argv:
        return "other"
    head, text = os.path.basename(argv[0]), " ".join(argv)
    if text.startswith("ray::"):
        # Ray titles a worker ray::Class.method while it runs a call (ray::0:Class.__init__
        # while it starts), ray::Class idle; its agents are actors too.
        name = text[5:].split(".")[0].split(" ")[0].split(":")[-1]
        return RAY_TITLES.get(name, f"actor {name}")
    if head in ("gcs_server", "raylet"):
        return f"ray {head}"
    if "uvicorn" in text and "prefect" in text:
        return "prefect server"
    for part, name in SCRIPTS.items():
        if part in text:
            return name
    return "other " + text[:60]


def rss_mb(pid: int) -> float | None:
    status = _read(f"/proc/{pid}/status")
    for line in (status or "").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * KB_MB
    return None


def sample(me: int) -> dict[str, float]:
    """RSS in MB by role (processes of one role summed)."""
    out: dict[str, float] = collections.defaultdict(float)
    for pid in descendants(me):
        name, mb = role(pid, me), rss_mb(pid)
        if name is not None and mb is not None:
            out[name] += mb
    return dict(out)


def committed(metrics_dir: str) -> int:
    try:
        return sum(1 for n in os.listdir(metrics_dir) if n.endswith(".json"))
    except FileNotFoundError:
        return 0


def census() -> collections.Counter:
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


class Sampler(threading.Thread):
    """Samples every ``interval`` s until the run has ``total`` iterations."""

    def __init__(self, metrics_dir: str, total: int, interval: float) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.metrics_dir, self.total, self.interval = metrics_dir, total, interval
        self.rows: list[dict[str, Any]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        me, t0 = os.getpid(), time.monotonic()
        while not self.halt.is_set():
            k = committed(self.metrics_dir)
            self.rows.append({"t": time.monotonic() - t0, "k": k, "rss": sample(me)})
            if k >= self.total:
                return
            self.halt.wait(self.interval)


def snapshot_at(ks: dict[int, str], census_on: bool, trace_on: bool) -> dict[str, Any]:
    """Take the census / tracemalloc snapshot in the flow's own thread right after
    iteration k of ``ks`` (a debug hook around the flow's ``run_iteration``: taken
    later, from the sampler, the flow run and what Prefect keeps in it are gone)."""
    import flows.rl_training as training

    taken: dict[str, Any] = {}
    run = training.run_iteration

    def run_and_snap(ctx, k):
        out = run(ctx, k)
        if k in ks:
            if census_on:
                taken[f"census_{ks[k]}"] = census()
            if trace_on:
                import tracemalloc

                if not tracemalloc.is_tracing():  # from the warm-up on: it slows the run
                    tracemalloc.start(8)
                taken[f"trace_{ks[k]}"] = tracemalloc.take_snapshot()
        return out

    training.run_iteration = run_and_snap
    return taken


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y on x (0 with fewer than two distinct x)."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def growth(rows: list[dict], warmup: int) -> dict[str, dict[str, float]]:
    """Per role: first size seen, size at the warm-up, at the end, MB per 1,000 iterations."""
    steady = [r for r in rows if r["k"] >= warmup]
    roles = sorted({name for r in rows for name in r["rss"]})
    out = {}
    for name in roles:
        seen = [r for r in rows if name in r["rss"]]
        pts = [(r["k"], r["rss"][name]) for r in steady if name in r["rss"]]
        if not seen:
            continue
        out[name] = {
            "first_mb": seen[0]["rss"][name],
            "warm_mb": pts[0][1] if pts else float("nan"),
            "end_mb": pts[-1][1] if pts else float("nan"),
            "mb_per_1000_iterations": 1000 * slope(pts),
        }
    return out


def print_debug(debug: dict[str, Any], top: int = 25) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "census_warm" in debug and "census_end" in debug:
        diff = debug["census_end"].copy()
        diff.subtract(debug["census_warm"])
        grown = [(t, n) for t, n in diff.most_common(top) if n > 0]
        print("\nflow process, live objects grown between warm-up and end (type: count):")
        for t, n in grown:
            print(f"  {t}: +{n} (now {debug['census_end'][t]})")
        out["census_growth"] = dict(grown)
    if "trace_warm" in debug and "trace_end" in debug:
        stats = debug["trace_end"].compare_to(debug["trace_warm"], "lineno")
        print("\nflow process, allocations grown between warm-up and end (tracemalloc):")
        lines = []
        for s in stats[:top]:
            line = f"  {s.size_diff / 1e6:+.2f} MB {s.count_diff:+d} blocks {s.traceback}"
            print(line)
            lines.append(line.strip())
        out["tracemalloc_growth"] = lines
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=700)
    ap.add_argument("--warmup", type=int, default=100, help="iterations before growth is measured")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--config", default="configs/tiny-cpu.yaml")
    ap.add_argument("--set", action="append", default=[], help="extra dotted overrides")
    ap.add_argument("--census", action="store_true", help="count the flow's objects by type")
    ap.add_argument("--tracemalloc", action="store_true", help="the flow's allocations by line")
    ap.add_argument("--out", default="bench/results/soak.json")
    args = ap.parse_args()

    from flows.config import parse_override
    from flows.rl_training import rl_training

    root = tempfile.mkdtemp(prefix="soak-", dir="/tmp")
    overrides = {
        "run.name": "bench-soak",
        "storage.root": root,
        "run.iterations": args.iterations,
        "storage.keep_last": 3,  # the disk stays small over thousands of versions
        **dict(parse_override(s) for s in args.set),
    }
    debug = snapshot_at(
        {args.warmup: "warm", args.iterations: "end"}, args.census, args.tracemalloc
    )
    sampler = Sampler(
        os.path.join(root, overrides["run.name"], "metrics"), args.iterations, args.interval
    )
    sampler.start()
    t0 = time.perf_counter()
    try:
        out = rl_training(config_path=args.config, overrides=overrides)
    finally:
        sampler.halt.set()
        sampler.join()
    wall = time.perf_counter() - t0
    table = growth(sampler.rows, args.warmup)
    print(
        f"\n{len(out['iterations'])} iterations in {wall:.0f} s, {len(sampler.rows)} samples; "
        f"growth fitted over iterations {args.warmup}..{args.iterations}\n"
    )
    print("| process | RSS first seen MB | at warm-up MB | at end MB | MB per 1,000 iterations |")
    print("|---|---|---|---|---|")
    for name, g in table.items():
        print(
            f"| {name} | {g['first_mb']:.0f} | {g['warm_mb']:.0f} | {g['end_mb']:.0f} "
            f"| {g['mb_per_1000_iterations']:+.1f} |"
        )
    debug = print_debug(debug)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "config": args.config,
                "overrides": overrides | {"storage.root": "/tmp/soak-*"},
                "iterations": args.iterations,
                "warmup": args.warmup,
                "wall_s": wall,
                "growth": table,
                **debug,
                "samples": sampler.rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
