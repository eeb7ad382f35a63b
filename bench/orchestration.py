"""Orchestration overhead: the same iterations through the plain-Python driver
and through the Prefect flow, over the same Ray actors, beside Prefect's floor.

One run: iterations 1..N with the plain driver, N+1..2N with ``rl_training``
(each step a task run on the flow's thread pool), then 2N+1..3N with the plain
driver again (a second baseline block, so machine noise hits both sides). The
per-iteration work is identical, so the difference is Prefect's overhead.

Prefect's floor: a flow run that walks the same plan (the same number of task
runs per iteration, the same options: persisted results, cache keys, retries) with tasks that do nothing. What Prefect costs above that floor is ours.

    .venv/bin/python -m bench.orchestration --iterations 5   (as a module: bench/rollout.py would shadow the rollout package)

A 0.5B model publishes 1 GB per iteration: add ``--set storage.keep_last=2`` there,
or the GPU machine's disk fills (the default config keeps every version).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def plain_block(ctx, ks: range) -> list[float]:
    from flows.driver import run_iteration

    out = []
    for k in ks:
        t0 = time.perf_counter()
        run_iteration(ctx, k)
        out.append(time.perf_counter() - t0)
    return out


def step_medians(store, ks: list[int]) -> dict[str, float]:
    """Median seconds of each committed step over iterations ``ks``, from the ledger
    (the runner times the same span under both drivers: the step's own work), and
    of each of its phases as ``step.phase`` (``tasks.runner.phase``)."""
    per: dict[str, list[float]] = {}
    for k in ks:
        for key in store.committed_steps(k):
            rec = store.read_record(k, key) or {}
            step = key.split("-e")[0]
            per.setdefault(step, []).append(float(rec.get("seconds", 0.0)))
            for name, s in (rec.get("phases") or {}).items():
                per.setdefault(f"{step}.{name}", []).append(float(s))
    return {key: statistics.median(xs) for key, xs in sorted(per.items())}


def prefect_floor(ctx, n: int) -> list[float]:
    """Seconds per iteration of the plan walked with no-op task runs (see module doc)."""
    from prefect import flow, task
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.iteration import result_storage
    from tasks import plan

    @task(name="noop", persist_result=True)
    def noop(k: int, node_id: str) -> dict[str, Any]:
        return {"k": k, "node": node_id}

    @flow(name="prefect-floor", task_runner=ThreadPoolTaskRunner(max_workers=32))
    def floor_flow() -> list[float]:
        storage = result_storage(ctx)
        seconds = []
        for k in range(1, n + 1):
            t0 = time.perf_counter()

            def start(node, done):
                t = noop.with_options(
                    task_run_name=f"floor:{node.id}",
                    cache_key_fn=lambda _c, p: f"floor/{time.time_ns()}/{p['node_id']}",
                    result_storage=storage,
                    retries=ctx.cfg.tasks.retries,
                )
                return t.submit(node.k, node.id)

            plan.walk(plan.iteration_plan(ctx, k), start)
            seconds.append(time.perf_counter() - t0)
        return seconds

    return floor_flow()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--config", default="configs/tiny-cpu.yaml")
    ap.add_argument("--set", action="append", default=[], help="extra dotted overrides")
    args = ap.parse_args()
    n = args.iterations

    from flows.config import load_config, parse_override
    from flows.rl_training import rl_training
    from tasks import retention
    from tasks.prepare import prepare_run

    root = tempfile.mkdtemp(prefix="bench-orch-")
    overrides = {
        "run.name": "bench-orch",
        "storage.root": root,
        "run.iterations": 3 * n,
        "run.save_interval": 1000,
        **dict(parse_override(s) for s in args.set),
    }
    cfg = load_config(args.config, overrides)
    ctx = prepare_run(cfg)
    plain = plain_block(ctx, range(1, n + 1))
    retention.wait(ctx)  # storage.keep_last's pass in flight: only the holder deletes
    ctx.store.release_lease(ctx.owner)

    t0 = time.perf_counter()
    out = rl_training(config_path=args.config, overrides={**overrides, "run.iterations": 2 * n})
    flow_total = time.perf_counter() - t0
    assert out["iterations"] == list(range(n + 1, 2 * n + 1)), out
    flow_iters = out["seconds"]

    ctx = prepare_run(cfg)
    plain += plain_block(ctx, range(2 * n + 1, 3 * n + 1))
    floor = prefect_floor(ctx, n)
    retention.wait(ctx)
    ctx.store.release_lease(ctx.owner)
    ctx.trainer().shutdown()
    ctx.engines().shutdown()

    # The first iteration of each block pays one-off costs (actor creation, the
    # flow's first task runs): medians skip it.
    def med(xs: list[float]) -> float:
        return statistics.median(xs[1:] or xs)

    plain_ks = list(range(2, n + 1)) + list(range(2 * n + 2, 3 * n + 1))
    steps_plain = step_medians(ctx.store, plain_ks or [1])
    steps_prefect = step_medians(ctx.store, list(range(n + 2, 2 * n + 1)) or [n + 1])
    row = {
        "iterations": n,
        "steps_plain_s": steps_plain,
        "steps_prefect_s": steps_prefect,
        "overrides": args.set,
        "plain_s_per_iter_median": statistics.median(plain[1:n] + plain[n + 1 :]),
        "prefect_s_per_iter_median": med(flow_iters),
        "prefect_floor_s_per_iter_median": med(floor),
        "prefect_flow_total_s": flow_total,
        "plain_s": plain,
        "prefect_s": flow_iters,
        "floor_s": floor,
        "loadavg": os.getloadavg(),
    }
    p, f, q = (
        row["plain_s_per_iter_median"],
        row["prefect_floor_s_per_iter_median"],
        row["prefect_s_per_iter_median"],
    )
    row["ratio"] = q / p
    row["overhead_s_per_iter"] = q - p
    row["above_floor_s_per_iter"] = q - p - f
    print("| driver | s/iteration (median, first of each block excluded) |\n|---|---|")
    print(f"| plain Python (threads) | {p:.3f} |")
    print(f"| Prefect flow (thread task runner) | {q:.3f} |")
    print(f"| Prefect's floor: the same task runs doing nothing | {f:.3f} |")
    print(f"| ratio Prefect / plain | {row['ratio']:.2f}x (+{q - p:.3f} s) |")
    print(f"| Prefect's cost above its floor | {row['above_floor_s_per_iter']:+.3f} s |")
    print(f"| whole flow run incl. start, {n} iterations | {flow_total:.1f} s |")
    # A step slower under Prefect than under the plain driver shows where the cost is.
    print(
        "\n| step (ledger seconds, median) | plain | Prefect | Prefect - plain |\n|---|---|---|---|"
    )
    for key in steps_plain:
        a, b = steps_plain[key], steps_prefect.get(key, float("nan"))
        print(f"| {key} | {a:.3f} | {b:.3f} | {b - a:+.3f} |")
    Path("bench/results").mkdir(parents=True, exist_ok=True)
    Path("bench/results/orchestration.json").write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
