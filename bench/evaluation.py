"""Benchmark: evaluate-versions throughput (prompts per second) against shard count,
engine count and engine kind, beside the in-process evaluation of the same run.

Each ``--config`` file is one variant (default: the tiny model on CPU, embedded
engine); its engines.kind names it. Per variant: a run under a temporary folder
(v0 from ``prepare_run``, v1 a perturbed copy), then the baseline, the
single-process evaluation (``rollout.evaluation.evaluate``) of both versions on
one engine already started, i.e. what evaluate[k] of an iteration does, without
Prefect, Ray tasks or engine starts; then each spec ENGINESxSHARD_SIZE (``--specs``;
``kind:ENGINESxSHARD_SIZE`` for one variant only) evaluates both versions on the
same builtin prompts (``--size`` of ``reverse``, ``--n-samples`` sampled answers
plus the greedy one, ``--max-new-tokens``) through the flow, each (version, shard)
a task run on RayTaskRunner, on engines the flow starts; cached shard results
are deleted between specs, so each one generates. One local Ray cluster and
Prefect's temporary server (``prefect_test_harness``) for the whole bench.

Figures per spec, each as prompts per second (prompts x versions / seconds):
the flow's whole wall time (plan, engine starts, loads, shards, record,
artifacts), the versions' (loads + shards, ``wall_s`` of each version) and the
shards' alone (``wall_s - load_s``: the engines serve, as in the baseline, whose
seconds are its ``evaluate`` calls alone). Machine-bound: on a 2-core machine
more engines or shards than cores cannot add throughput.

    python -m bench.evaluation                       # writes bench/results/evaluation_cpu.json
    python -m bench.evaluation --size 32 --specs 1x32 2x8
    # CUDA, the 0.5B shape, embedded and SGLang: scripts/gpu_sglang.sh eval
    python -m bench.evaluation --config configs/gpu-0.5b.yaml /tmp/gpu-0.5b-sglang.yaml \
        --specs embedded:1x128 1x32 2x32 --size 128 --max-new-tokens 16 --out OUT.json
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
from typing import Any

_BENCH = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _BENCH]
sys.path.insert(0, str(_BENCH.parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def publish_perturbed(ctx, v: int, work: Path) -> None:
    """Commit version v of the run as v0's weights plus seeded noise (no training: an
    evaluation takes any committed version); ``work`` holds the new weights file (and,
    on an object-store root, v0's verified pull)."""
    work.mkdir(parents=True)
    src = ctx.store.local_version_dir(0) or ctx.store.pull_version(0, str(work / "pulled"))
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
    """Seconds of rollout.evaluation.evaluate of ``versions`` on one started engine
    (its start and the reload between versions not counted)."""
    from engines.group import EngineGroup
    from rollout.evaluation import EvalConfig, evaluate
    from tasks.serving.engine import disk_reload

    cfg = ctx.cfg
    engines = cfg.engines.model_copy(update={"num_engines": 1})
    group = EngineGroup(f"{ctx.run_name}/bench-base", engines, cfg.ray.namespace)
    group.start(ctx.store.local_version_dir(versions[0]), versions[0])
    ev = EvalConfig(dataset="reverse", size=size, n_samples=n)
    spent = 0.0
    try:
        for v in versions:
            if v != versions[0]:
                disk_reload(ctx, group, 0, v, ctx.store.local_version_dir(v))
            t0 = time.perf_counter()
            evaluate(
                ev, cfg.rollout, cfg.run.seed, v, v, ctx.tokenizer(),
                group.generate_groups, lambda i: None,
            )  # fmt: skip
            spent += time.perf_counter() - t0
        return spent
    finally:
        group.shutdown()


def _warm_workers(count: int) -> None:
    """``count`` Ray workers at once that import what a shard task imports, so that
    no spec pays for starting the workers its shards run in (Ray keeps them)."""
    import ray

    @ray.remote(num_cpus=0)
    def imported() -> int:
        import flows.evaluation  # noqa: F401  (prefect, torch, the rollout)

        time.sleep(1.0)  # held, so that the calls spread over ``count`` workers
        return os.getpid()

    ray.get([imported.remote() for _ in range(count)])


def _prepare(config: str | None, tmp: Path, over: dict[str, Any]):
    """A run of ``config`` with v0 and v1 (a perturbed copy); no lease held."""
    from flows.config import load_config
    from tasks import lease as run_lease
    from tasks.prepare import prepare_run

    kind = load_config(config, over).engines.kind
    name = f"bench-eval-{kind}"
    cfg = load_config(config, {**over, "run.name": name})
    ctx = prepare_run(cfg)
    publish_perturbed(ctx, 1, tmp / name / "v1")
    run_lease.release(ctx)  # stops the renewals prepare_run started, then releases
    return ctx


def _specs(specs: list[str], kind: str) -> list[tuple[int, int]]:
    """(engines, shard size) of the specs that apply to ``kind``."""
    out = []
    for spec in specs:
        only, _, size = spec.rpartition(":")
        if only in ("", kind):
            engines, shard = (int(x) for x in size.split("x"))
            out.append((engines, shard))
    return out


def _bench_variant(ctx, args, specs: list[tuple[int, int]]) -> dict[str, Any]:
    from flows.evaluation import evaluate_versions

    versions, prompts = [0, 1], args.size * 2
    kind = ctx.cfg.engines.kind
    base_s = _baseline(ctx, args.size, args.n_samples, versions)
    print(f"[{kind}] baseline (evaluate on 1 started engine): {prompts / base_s:.1f} prompts/s")
    rows = []
    for engines, shard in specs:
        shutil.rmtree(f"{ctx.store.url}/prefect-results", ignore_errors=True)
        t0 = time.perf_counter()
        out = evaluate_versions(
            run_name=ctx.run_name, storage_root=ctx.cfg.storage.root, versions="0..1",
            dataset="reverse", size=args.size, n_samples=args.n_samples,
            shard_size=shard, num_engines=engines, shard_cpus=1.0,
        )  # fmt: skip
        flow_s = time.perf_counter() - t0
        versions_s = sum(r["wall_s"] for r in out["scores"])
        shards_s = sum(r["wall_s"] - r["load_s"] for r in out["scores"])
        row = {
            "engines": engines,
            "shard_size": shard,
            "shards": -(-args.size // shard),
            "flow_s": round(flow_s, 2),
            "versions_s": round(versions_s, 2),
            "shards_s": round(shards_s, 2),
            "load_s": [round(r["load_s"], 2) for r in out["scores"]],
            "prompts_per_s_flow": round(prompts / flow_s, 2),
            "prompts_per_s_versions": round(prompts / versions_s, 2),
            "prompts_per_s_shards": round(prompts / shards_s, 2),
            "baseline_prompts_per_s": round(prompts / base_s, 2),
        }
        rows.append(row)
        print(
            f"[{kind}] {engines} engines, {row['shards']} shards of {shard}: flow {flow_s:.1f} s "
            f"({row['prompts_per_s_flow']} prompts/s), loads {row['load_s']} s, shards "
            f"{shards_s:.1f} s ({row['prompts_per_s_shards']} prompts/s); "
            f"baseline {row['baseline_prompts_per_s']} prompts/s"
        )
    return {
        "kind": kind,
        "model": ctx.cfg.model.path or "tiny",
        "dtype": ctx.cfg.model.dtype,
        "baseline_s": round(base_s, 2),
        "baseline_prompts_per_s": round(prompts / base_s, 2),
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", nargs="+", default=[None], help="run config files, one per variant")
    ap.add_argument("--set", action="append", default=[], help="extra dotted overrides")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--n-samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument(
        "--specs", nargs="+", default=["1x64", "1x16", "2x16", "2x8", "4x8"],
        help="ENGINESxSHARD_SIZE, or KIND:ENGINESxSHARD_SIZE for one engine kind",
    )  # fmt: skip
    ap.add_argument("--no-warmup", action="store_true", help="skip warming Ray's workers")
    ap.add_argument("--out", default=str(_BENCH / "results" / "evaluation_cpu.json"))
    args = ap.parse_args()

    from prefect.testing.utilities import prefect_test_harness

    from flows.config import parse_override
    from tasks.cluster import connect_ray

    tmp = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    over = {
        "storage.root": str(tmp / "runs"),
        "rollout.max_new_tokens": args.max_new_tokens,
        "ray.num_cpus": 16,
        **({"engines.num_cpus_per_engine": 0.5} if args.config == [None] else {}),
        **dict(parse_override(s) for s in args.set),
    }
    t_start, variants = time.perf_counter(), []
    with prefect_test_harness(server_startup_timeout=120):
        ctxs = [_prepare(config, tmp, over) for config in args.config]
        todo = [(ctx, _specs(args.specs, ctx.cfg.engines.kind)) for ctx in ctxs]
        if not args.no_warmup:
            connect_ray(ctxs[0].cfg)
            _warm_workers(max(-(-args.size // s) for _, specs in todo for _, s in specs))
        for ctx, specs in todo:
            variants.append(_bench_variant(ctx, args, specs))
            shutil.rmtree(ctx.store.url, ignore_errors=True)  # 0.5B: 1 GB per version
    result = {
        "bench": "evaluation",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "gpu": _gpu()},
        "size": args.size,
        "versions": [0, 1],
        "n_samples": args.n_samples,
        "max_new_tokens": args.max_new_tokens,
        "total_s": round(time.perf_counter() - t_start, 1),
        "variants": variants,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} ({result['total_s']} s)")
    shutil.rmtree(tmp, ignore_errors=True)


def _gpu() -> str | None:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
