"""Orchestration overhead: the same iterations through the plain-Python driver
and through the Prefect flow (RayTaskRunner), over the same Ray actors.

Iterations 1..N run with the plain driver, then N+1..2N of the same run with
``rl_training``: one Ray cluster, the same named engine and train actors. The
per-iteration work is identical, so the difference is Prefect's overhead.

    .venv/bin/python -m bench.orchestration --iterations 5   (as a module: bench/rollout.py would shadow the rollout package)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--config", default="configs/tiny-cpu.yaml")
    args = ap.parse_args()
    n = args.iterations

    from flows.config import load_config
    from flows.driver import run_iteration
    from flows.rl_training import TrainingParams, rl_training
    from tasks.prepare import prepare_run

    root = tempfile.mkdtemp(prefix="bench-orch-")
    overrides = {
        "run.name": "bench-orch",
        "storage.root": root,
        "run.iterations": n,
        "run.save_interval": 1000,
    }
    cfg = load_config(args.config, overrides)
    ctx = prepare_run(cfg)
    plain: list[float] = []
    for k in range(1, n + 1):
        t0 = time.perf_counter()
        run_iteration(ctx, k)
        plain.append(time.perf_counter() - t0)
    ctx.store.release_lease(ctx.owner)

    t0 = time.perf_counter()
    out = rl_training(
        TrainingParams(config_path=args.config, overrides={**overrides, "run.iterations": 2 * n})
    )
    flow_total = time.perf_counter() - t0
    assert out["iterations"] == list(range(n + 1, 2 * n + 1)), out
    # The first iteration of each driver pays one-off costs (actor creation for
    # the plain driver; Ray task workers importing torch for the flow): medians skip it.
    flow_iters = out["seconds"]
    row = {
        "iterations": n,
        "plain_s_per_iter_median": statistics.median(plain[1:] or plain),
        "prefect_s_per_iter_median": statistics.median(flow_iters[1:] or flow_iters),
        "prefect_flow_total_s": flow_total,
    }
    row["ratio"] = row["prefect_s_per_iter_median"] / row["plain_s_per_iter_median"]
    row["overhead_s_per_iter"] = row["prefect_s_per_iter_median"] - row["plain_s_per_iter_median"]
    print("| driver | s/iteration (median, first excluded) |\n|---|---|")
    print(f"| plain Python | {row['plain_s_per_iter_median']:.2f} |")
    print(f"| Prefect flow + RayTaskRunner | {row['prefect_s_per_iter_median']:.2f} |")
    print(f"| ratio Prefect / plain | {row['ratio']:.2f}x (+{row['overhead_s_per_iter']:.2f} s) |")
    print(f"| whole flow run incl. start, {n} iterations | {flow_total:.1f} s |")
    Path("bench/results").mkdir(parents=True, exist_ok=True)
    Path("bench/results/orchestration.json").write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
