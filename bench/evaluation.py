"""Benchmark: evaluate-versions throughput (prompts per second) against shard count
and engine count, on CPU with the tiny model.

One tiny run (v0 from ``prepare_run``, v1 a perturbed copy) under a temporary
folder, a local Ray cluster of this process and Prefect's temporary server
(``prefect_test_harness``). Each configuration (engines, shard size) evaluates
both versions on the same builtin prompts (``--size`` of ``reverse``,
``--n-samples`` sampled answers plus the greedy one, ``max_new_tokens`` 8)
through the flow, each (version, shard) a task run on RayTaskRunner; cached
shard results are deleted between configurations, so each one generates. The
baseline, from the same run, is the single-process evaluation
(``rollout.evaluation.evaluate``) on one engine already started, i.e. what
evaluate[k] of an iteration does, without Prefect, Ray tasks or engine starts.

Figures per configuration: the flow's whole wall time (plan, engine starts,
loads, shards, record, artifacts) and the versions' wall time (load + shards,
``wall_s`` of each version), each as prompts per second (prompts x versions /
seconds). Machine-bound: on a 2-core machine more engines or shards than cores
cannot add throughput; the figure says what the orchestration costs there.

    python -m bench.evaluation                       # writes bench/results/evaluation_cpu.json
    python -m bench.evaluation --size 32 --configs 1x32 2x8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

_BENCH = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _BENCH]
sys.path.insert(0, str(_BENCH.parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def publish_perturbed(ctx, v: int, work: Path) -> None:
    """Commit version v of the run as v0's weights plus seeded noise (no training: an
    evaluation takes any committed version); ``work`` holds the new weights file."""
    src = ctx.store.local_version_dir(0)
    work.mkdir(parents=True)
    gen = torch.Generator().manual_seed(v)
    tensors = load_file(f"{src}/model.safetensors")
    noisy = {
        k: t + 0.05 * torch.randn(t.shape, generator=gen).to(t.dtype) for k, t in tensors.items()
    }
    save_file(noisy, str(work / "model.safetensors"), metadata={"format": "pt"})
    writer = ctx.store.weights_writer(v, v, v - 1)
    for f in ctx.store.read_manifest(0).files:
        path = work / f.name if f.name == "model.safetensors" else f"{src}/{f.name}"
        writer.add_file(f.name, str(path))
    writer.commit()


def _baseline(ctx, size: int, n: int, versions: list[int]) -> float:
    """Seconds of rollout.evaluation.evaluate of ``versions`` on one started engine."""
    from engines.group import EngineGroup
    from rollout.evaluation import EvalConfig, evaluate
    from tasks.engines import disk_reload

    group = EngineGroup(f"{ctx.run_name}/bench-base", ctx.cfg.engines, ctx.cfg.ray.namespace)
    group.start(ctx.store.local_version_dir(versions[0]), versions[0])
    ev = EvalConfig(dataset="reverse", size=size, n_samples=n)
    t0 = time.perf_counter()
    try:
        for v in versions:
            if v != versions[0]:
                disk_reload(ctx, group, 0, v, ctx.store.local_version_dir(v))
            evaluate(
                ev, ctx.cfg.rollout, ctx.cfg.run.seed, v, v, ctx.tokenizer(),
                group.generate_groups, lambda i: None,
            )  # fmt: skip
        return time.perf_counter() - t0
    finally:
        group.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--n-samples", type=int, default=4)
    ap.add_argument(
        "--configs", nargs="+", default=["1x64", "1x16", "2x16", "2x8", "4x8"],
        help="ENGINESxSHARD_SIZE",
    )  # fmt: skip
    ap.add_argument("--out", default=str(_BENCH / "results" / "evaluation_cpu.json"))
    args = ap.parse_args()

    from prefect.testing.utilities import prefect_test_harness

    from flows.config import load_config
    from flows.evaluation import evaluate_versions
    from tasks import lease as run_lease
    from tasks.prepare import prepare_run

    tmp = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    cfg = load_config(
        None,
        {
            "run.name": "bench-eval",
            "storage.root": str(tmp / "runs"),
            "engines.num_cpus_per_engine": 0.5,
            "ray.num_cpus": 16,
            "rollout.max_new_tokens": 8,
        },
    )
    rows, warmed = [], False
    with prefect_test_harness(server_startup_timeout=120):
        ctx = prepare_run(cfg)
        publish_perturbed(ctx, 1, tmp / "v1")
        run_lease.release(ctx)  # stops the renewals prepare_run started, then releases
        versions, prompts = [0, 1], args.size * 2
        base_s = _baseline(ctx, args.size, args.n_samples, versions)
        print(
            f"baseline (evaluate on 1 started engine): {base_s:.2f} s, {prompts / base_s:.1f} prompts/s"
        )
        # Unrecorded first: the configuration with the most shards, so that Ray's worker
        # pool holds as many warm workers (prefect and torch imported) as any
        # configuration's concurrent shards; else the first to need a worker pays for it.
        widest = max(args.configs, key=lambda spec: -(-args.size // int(spec.split("x")[1])))
        for spec in [widest, *args.configs]:
            engines, shard = (int(x) for x in spec.split("x"))
            shutil.rmtree(f"{ctx.store.url}/prefect-results", ignore_errors=True)
            t0 = time.perf_counter()
            out = evaluate_versions(
                run_name=ctx.run_name, storage_root=cfg.storage.root, versions="0..1",
                dataset="reverse", size=args.size, n_samples=args.n_samples,
                shard_size=shard, num_engines=engines, shard_cpus=1.0,
            )  # fmt: skip
            flow_s = time.perf_counter() - t0
            if len(rows) == 0 and not warmed:
                warmed = True
                print(f"warm-up ({spec}): flow {flow_s:.1f} s, not recorded")
                continue
            versions_s = sum(r["wall_s"] for r in out["scores"])
            row = {
                "engines": engines,
                "shard_size": shard,
                "shards": -(-args.size // shard),
                "flow_s": round(flow_s, 2),
                "versions_s": round(versions_s, 2),
                "prompts_per_s_flow": round(prompts / flow_s, 2),
                "prompts_per_s_versions": round(prompts / versions_s, 2),
                "baseline_prompts_per_s": round(prompts / base_s, 2),
            }
            rows.append(row)
            print(
                f"{engines} engines, {row['shards']} shards of {shard}: flow {flow_s:.1f} s "
                f"({row['prompts_per_s_flow']} prompts/s), versions {versions_s:.1f} s "
                f"({row['prompts_per_s_versions']} prompts/s); baseline {row['baseline_prompts_per_s']}"
            )
    result = {
        "bench": "evaluation",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "size": args.size,
        "versions": versions,
        "n_samples": args.n_samples,
        "max_new_tokens": 8,
        "baseline_s": round(base_s, 2),
        "baseline_prompts_per_s": round(prompts / base_s, 2),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
