"""Pipelining: per-iteration wall time beside the sum and the max of the steps' compute.

For each ``rollout.max_staleness`` N (0: on-policy chain, N: rollout[k+N] beside
train[k]) one run of the Prefect flow (each step a task run, as users run it),
steady state (the first two iterations and the last max(N, 1) excluded: those make
no batch ahead). Each step's compute is the time its ledger record took, in the
iteration unit that ran it (with staleness N the rollout of iteration k's unit is
rollout[k+N]; with ``--partial`` its head and its continuation together). Beside
the timing, learning per wall-clock second (``learning``): the slope of each batch's
reward against the time its weights were published, after the first iteration
(which starts the engines).
The goals read:

    staleness >= 1: wall <= 1.25 x max(rollout, train)
    staleness 0: wall <= 1.15 x (rollout + train + reload)    (reload = the weight sync)

    .venv/bin/python -m bench.pipeline --iterations 20 --staleness 0 1 2 4 \
        --out bench/results/pipeline_staleness_cpu.json
    python -m bench.pipeline --config configs/gpu-0.5b.yaml --iterations 8 --set weights.transport=tensor
    python -m bench.pipeline --config configs/gpu-0.5b-sglang.yaml --staleness 0 1 2 4 --partial \
        --set train.loss.rollout_correction.kind=tis
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

STEPS = ("rollout", "train", "save", "publish", "reload", "verify", "iteration")


def unit_seconds(store, k: int, staleness: int, iterations: int) -> dict[str, float]:
    """Compute seconds of each step in iteration k's unit (per-engine steps: the slowest;
    a partial rollout: its head and its continuation)."""
    out: dict[str, float] = {}
    for step in STEPS:
        j = k + staleness if step == "rollout" else k
        if step == "rollout" and j > iterations:
            j = k  # the last units make no batch ahead
        keys = [s for s in store.committed_steps(j) if s == step or s.startswith(f"{step}-e")]
        out[step] = max((store.read_record(j, s)["seconds"] for s in keys), default=0.0)
        if step == "rollout" and "rollout_head" in store.committed_steps(j):
            out[step] += store.read_record(j, "rollout_head")["seconds"]
    return out


def learning(store, walls: list[float]) -> dict[str, Any]:
    """Learning per wall-clock second, from the rollouts' rewards (with dynamic sampling,
    of everything generated: the kept batch's is lifted by the filter).

    Batch k's reward measures the weights that generated it (the row's
    ``rollout_version``: v(k-1-N) at staleness N), not the newest. Plotted by
    iteration, a deeper staleness shows each version's reward N iterations later, and
    over a short run that lag alone lowers its curve (SmolLM2 on the H100, staleness 2
    against 1: 0.78-1.00x by iteration in four seed pairs; credited to each version's
    time, 0.85-1.16x in five, mean 0.99x). So the figure that compares staleness
    levels is ``reward_slope_per_s``: each batch's reward at the wall-clock time its
    version was published (the end of the iteration that trained it), least squares
    over versions >= 1 (version 0 predates the clock, which starts after iteration 1
    and its engine start: 70-100 s with SGLang on the H100, the same at every
    staleness). Beside it, as before: the rollout reward of the first and last 5
    iterations and their gain per wall second of the iterations after the first."""
    rows = store.read_metrics()
    rewards = [m.get("reward_mean_generated", m["reward_mean"]) for m in rows]
    first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    versions = [m["rollout_version"] for m in rows]
    ends = [sum(walls[1:m]) for m in range(1, len(walls) + 1)]  # ends[v-1]: v published
    points = [(ends[v - 1], reward) for v, reward in zip(versions, rewards) if v >= 1]
    slope = statistics.linear_regression(*zip(*points)).slope if len(points) >= 2 else None
    return {
        "reward_first5": first,
        "reward_last5": last,
        "run_wall_s": sum(walls[1:]),
        "first_iteration_s": walls[0],
        "reward_gain_per_s": (last - first) / sum(walls[1:]),
        "reward_slope_per_s": slope,
        "rewards": rewards,
        "versions": versions,
        "sampling_rounds": [m.get("sampling_rounds") for m in rows],
    }


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


def run_one(
    config: str,
    overrides: dict[str, Any],
    staleness: int,
    n: int,
    partial: bool = False,
    seed: int | None = None,
    keep: bool = True,
) -> dict[str, Any]:
    """One run at ``staleness``: its row of figures. ``keep=False`` deletes the run's
    folder once its row is read (0.5B: about 10 GB of checkpoints and versions)."""
    from bench.orchestration import step_medians
    from flows.config import load_config
    from flows.rl_training import rl_training
    from storage.run_store import RunStore

    seeded = {} if seed is None else {"run.seed": seed}
    over = {
        **overrides,
        **seeded,
        "run.name": f"bench-pipe-s{staleness}{'-partial' if partial else ''}"
        + ("" if seed is None else f"-seed{seed}"),
        "run.iterations": n,
        "rollout.max_staleness": staleness,
    }
    if partial and staleness:  # staleness 0 makes no batch ahead to split
        over["rollout.partial"] = True
    with commit_timer() as commits:
        out = rl_training(config_path=config, overrides=over)
    cfg = load_config(config, over)
    store = RunStore(cfg.storage, cfg.run.name)
    skip = 2  # actor start, first task runs, the first batch made before any overlap
    # The last iteration is not steady state either: the run's end waits for its save
    # and publish in the foreground (6.8 s against 3.4 s on the H200 at 0.5B).
    last = n - max(staleness, 1) if n - skip > max(staleness, 1) else n
    walls = out["seconds"][skip:last]
    units = [unit_seconds(store, k, staleness, n) for k in range(skip + 1, last + 1)]

    def med(key: str) -> float:
        return statistics.median(u[key] for u in units)

    row: dict[str, Any] = {
        "max_staleness": staleness,
        "partial": bool(over.get("rollout.partial")),
        "seed": cfg.run.seed,
        "wall_s": statistics.median(walls),
    }
    row.update({f"{s}_s": med(s) for s in STEPS})
    row["sum_s"] = statistics.median(sum(u.values()) for u in units)
    row["max_rollout_train_s"] = statistics.median(max(u["rollout"], u["train"]) for u in units)
    row["chain_s"] = statistics.median(u["rollout"] + u["train"] + u["reload"] for u in units)
    # Means beside the medians: where rollouts vary batch to batch (dynamic sampling's
    # rounds, long tails), a batch made further ahead absorbs the slow ones, and the
    # mean wall shows it where the median hides it.
    row["wall_mean_s"] = statistics.mean(walls)
    row["rollout_mean_s"] = statistics.mean(u["rollout"] for u in units)
    row["max_rollout_train_mean_s"] = statistics.mean(max(u["rollout"], u["train"]) for u in units)
    row["wall_over_sum"] = row["wall_s"] / row["sum_s"]
    row["wall_over_max"] = row["wall_s"] / row["max_rollout_train_s"]
    row["wall_over_chain"] = row["wall_s"] / row["chain_s"]
    row["walls"] = out["seconds"]
    row.update(learning(store, out["seconds"]))
    # The ledger's own writes (fsynced records and metrics rows) are outside every
    # step's seconds: their sum per iteration, beside the wall.
    row["commit_s"] = statistics.median(commits.get(k, 0.0) for k in range(skip + 1, last + 1))
    # Where each step's seconds go (tasks.runner.phase), e.g. the finish step's retention.
    medians = step_medians(store, list(range(skip + 1, last + 1)))
    row["phases_s"] = {key: s for key, s in medians.items() if "." in key}
    row["engine_starts_s"] = engine_starts(store, n)
    if not keep:
        store.fs.rm(store.url, recursive=True)
    return row


def engine_starts(store, iterations: int) -> list[float]:
    """Seconds of each engine start in the run, from start to ready to serve (the
    ``start`` phase of the step that started it: the first rollout's, or a revival's)."""
    out = []
    for k in range(1, iterations + 1):
        for key in store.committed_steps(k):
            phases = (store.read_record(k, key) or {}).get("phases") or {}
            if "start" in phases:
                out.append(phases["start"])
    return out


def print_across_seeds(rows: list[dict[str, Any]]) -> None:
    """With several seeds: each staleness's mean gain and slope per wall second, their
    range over the seeds (the noise), and the mean beside the first staleness's."""
    for key in ("reward_gain_per_s", "reward_slope_per_s"):
        by: dict[int, list[float]] = {}
        for r in rows:
            by.setdefault(r["max_staleness"], []).append(r[key])
        if max(len(g) for g in by.values()) < 2:
            return
        first = statistics.mean(next(iter(by.values())))
        for staleness, gains in by.items():
            mean = statistics.mean(gains)
            print(
                f"staleness {staleness}: {key} {mean:.5f} over {len(gains)} seeds "
                f"(range {min(gains):.5f}-{max(gains):.5f})"
                + (f", {mean / first:.2f}x the first staleness's" if first else "")
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--config", default="configs/tiny-cpu.yaml")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--partial", action="store_true", help="rollout.partial at staleness >= 1")
    ap.add_argument("--set", action="append", default=[], help="extra dotted overrides")
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[None],
        help="run.seed of each repeat (default: the config's): the spread of the learning "
        "figures across seeds is their noise",
    )
    ap.add_argument("--out", default="bench/results/pipeline.json")
    args = ap.parse_args()
    # Learning per second fits batches of versions >= 1: at staleness N, batches N+2 on.
    short = [n for n in args.staleness if args.iterations < n + 3]
    if short:
        ap.error(
            f"--iterations {args.iterations} leaves staleness {short} fewer than two batches "
            f"made by trained weights; use --iterations {max(short) + 3} or more"
        )

    from flows.config import parse_override

    given = dict(parse_override(s) for s in args.set)
    scratch = None if "storage.root" in given else tempfile.mkdtemp(prefix="bench-pipe-")
    overrides = {
        "storage.root": scratch,
        "run.save_interval": 1,  # every iteration saves: the async save is on trial too
        # 0.5B: 3 GB of checkpoint and 1 GB of weights per iteration would fill the disk
        "storage.keep_last": 2,
        **given,
    }
    try:  # runs in a scratch root are deleted as they end; a given root is kept
        rows = [
            run_one(args.config, overrides, s, args.iterations, args.partial, seed, scratch is None)
            for seed in args.seeds
            for s in args.staleness
        ]
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
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
        print(
            f"staleness {r['max_staleness']}, engine starts (s, to ready): {r['engine_starts_s']}"
        )
    print(
        "| staleness | partial | seed | run wall s | mean wall s | mean max(rollout,train) "
        "| reward first 5 | last 5 | gain per wall s | reward slope per wall s (by version) |"
    )
    print("|---" * 10 + "|")
    for r in rows:  # learning per wall-clock second
        print(
            f"| {r['max_staleness']} | {r['partial']} | {r['seed']} | {r['run_wall_s']:.1f} | "
            f"{r['wall_mean_s']:.3f} | {r['max_rollout_train_mean_s']:.3f} | "
            f"{r['reward_first5']:.3f} | {r['reward_last5']:.3f} | "
            f"{r['reward_gain_per_s']:.5f} | {r['reward_slope_per_s']:.5f} |"
        )
    print_across_seeds(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {"config": args.config, "set": args.set, "partial": args.partial, "rows": rows},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
