"""Pipelining: per-iteration wall time beside the sum and the max of the steps' compute.

For each ``rollout.max_staleness`` (0: on-policy chain, 1: rollout[k+1] beside
train[k]) one run of the Prefect flow (each step a task run, as users run it),
steady state (the first two iterations and the last excluded). Each step's compute is the time
its ledger record took, in the iteration unit that ran it (with staleness 1 the
rollout of iteration k's unit is rollout[k+1]). The goals read:

    staleness 1: wall <= 1.25 x max(rollout, train)
    staleness 0: wall <= 1.15 x (rollout + train + reload)    (reload = the weight sync)

    .venv/bin/python -m bench.pipeline --iterations 8
    python -m bench.pipeline --config configs/gpu-0.5b.yaml --iterations 8 --set weights.transport=tensor
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

STEPS = ("rollout", "train", "save", "publish", "reload", "verify", "iteration")


def unit_seconds(store, k: int, staleness: int, iterations: int) -> dict[str, float]:
    """Compute seconds of each step in iteration k's unit (per-engine steps: the slowest)."""
    out: dict[str, float] = {}
    for step in STEPS:
        j = k + staleness if step == "rollout" else k
        if step == "rollout" and j > iterations:
            j = k  # the last unit makes no batch ahead
        keys = [s for s in store.committed_steps(j) if s == step or s.startswith(f"{step}-e")]
        out[step] = max((store.read_record(j, s)["seconds"] for s in keys), default=0.0)
    return out


@contextlib.contextmanager
def commit_timer():
    """Seconds spent in ``RunStore.write_record`` and ``append_metrics``, by iteration
    (patched on the class for the run's duration, in this process: the flow's)."""
    from storage.run_store import RunStore

    spent: dict[int, float] = {}
    saved = {name: getattr(RunStore, name) for name in ("write_record", "append_metrics")}

    def timed(fn):
        def wrapper(self, k, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(self, k, *args, **kwargs)
            finally:
                spent[k] = spent.get(k, 0.0) + time.perf_counter() - t0

        return wrapper

    for name, fn in saved.items():
        setattr(RunStore, name, timed(fn))
    try:
        yield spent
    finally:
        for name, fn in saved.items():
            setattr(RunStore, name, fn)


def run_one(config: str, overrides: dict[str, Any], staleness: int, n: int) -> dict[str, Any]:
    from bench.orchestration import step_medians
    from flows.config import load_config
    from flows.rl_training import rl_training
    from storage.run_store import RunStore

    over = {
        **overrides,
        "run.name": f"bench-pipe-s{staleness}",
        "run.iterations": n,
        "rollout.max_staleness": staleness,
    }
    with commit_timer() as commits:
        out = rl_training(config_path=config, overrides=over)
    cfg = load_config(config, over)
    store = RunStore(cfg.storage, cfg.run.name)
    skip = 2  # actor start, first task runs, the first batch made before any overlap
    # The last iteration is not steady state either: the run's end waits for its save
    # and publish in the foreground (6.8 s against 3.4 s on the H200 at 0.5B).
    last = n - 1 if n - skip > 1 else n
    walls = out["seconds"][skip:last]
    units = [unit_seconds(store, k, staleness, n) for k in range(skip + 1, last + 1)]

    def med(key: str) -> float:
        return statistics.median(u[key] for u in units)

    row: dict[str, Any] = {"max_staleness": staleness, "wall_s": statistics.median(walls)}
    row.update({f"{s}_s": med(s) for s in STEPS})
    row["sum_s"] = statistics.median(sum(u.values()) for u in units)
    row["max_rollout_train_s"] = statistics.median(max(u["rollout"], u["train"]) for u in units)
    row["chain_s"] = statistics.median(u["rollout"] + u["train"] + u["reload"] for u in units)
    row["wall_over_sum"] = row["wall_s"] / row["sum_s"]
    row["wall_over_max"] = row["wall_s"] / row["max_rollout_train_s"]
    row["wall_over_chain"] = row["wall_s"] / row["chain_s"]
    row["walls"] = out["seconds"]
    # The ledger's own writes (fsynced records and metrics rows) are outside every
    # step's seconds: their sum per iteration, beside the wall.
    row["commit_s"] = statistics.median(commits.get(k, 0.0) for k in range(skip + 1, last + 1))
    # Where each step's seconds go (tasks.runner.phase), e.g. the finish step's retention.
    medians = step_medians(store, list(range(skip + 1, last + 1)))
    row["phases_s"] = {key: s for key, s in medians.items() if "." in key}
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--config", default="configs/tiny-cpu.yaml")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--set", action="append", default=[], help="extra dotted overrides")
    ap.add_argument("--out", default="bench/results/pipeline.json")
    args = ap.parse_args()

    from flows.config import parse_override

    overrides = {
        "storage.root": tempfile.mkdtemp(prefix="bench-pipe-"),
        "run.save_interval": 1,  # every iteration saves: the async save is on trial too
        # 0.5B: 3 GB of checkpoint and 1 GB of weights per iteration would fill the disk
        "storage.keep_last": 2,
        **dict(parse_override(s) for s in args.set),
    }
    rows = [run_one(args.config, overrides, s, args.iterations) for s in args.staleness]
    print(
        "| staleness | wall s/iter | rollout | train | save | publish | reload | verify "
        "| sum | max(rollout,train) | wall/sum | wall/max | wall/(rollout+train+reload) |"
    )
    print("|---" * 13 + "|")
    for r in rows:
        print(
            f"| {r['max_staleness']} | {r['wall_s']:.3f} | {r['rollout_s']:.3f} | "
            f"{r['train_s']:.3f} | {r['save_s']:.3f} | {r['publish_s']:.3f} | "
            f"{r['reload_s']:.3f} | {r['verify_s']:.3f} | {r['sum_s']:.3f} | "
            f"{r['max_rollout_train_s']:.3f} | {r['wall_over_sum']:.2f}x | "
            f"{r['wall_over_max']:.2f}x | {r['wall_over_chain']:.2f}x |"
        )
    for r in rows:  # the largest phases: where a step's seconds go
        top = sorted(r["phases_s"].items(), key=lambda kv: -kv[1])[:8]
        shown = ", ".join(f"{key} {s:.3f}" for key, s in top)
        print(f"staleness {r['max_staleness']}, phases (median s): {shown}")
        print(f"staleness {r['max_staleness']}, ledger writes per iteration: {r['commit_s']:.3f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"config": args.config, "set": args.set, "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
