"""The ``prefect-rl`` command line."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.config import RunConfig

# What a command's processes start with unless the user's environment says otherwise.
# Without PREFECT_API_URL, Prefect starts a temporary server on the first flow run,
# and that server takes its settings from this process's environment: with analytics
# on, it posts telemetry at start and, off the internet, logs "ERROR | Failed to send
# telemetry" as the run's first line. Set before Prefect is imported, so this
# process's own settings agree (scripts/run.sh exports the same). An environment
# variable outranks a Prefect profile: to keep analytics on, export it as true.
PREFECT_DEFAULTS = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def set_prefect_defaults() -> None:
    """Set each of ``PREFECT_DEFAULTS`` in the environment unless it is set there already."""
    for name, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(name, value)


def _run(args: argparse.Namespace) -> int:
    from flows.config import ConfigError, load_config
    from storage.errors import StorageError

    try:
        cfg = load_config(args.config, args.set)
        if cfg.ray.address is None:
            # Only the run's own local cluster, which binds loopback alone
            # (tasks.cluster.start_local_ray), goes without auth. A cluster at
            # ray.address keeps the user's RAY_AUTH_MODE (token: docs/security.md).
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        from tasks.prepare import check_run

        # Before rl_training: a refused config creates no flow run, so nothing
        # of it (a secret in a URL, say) reaches the Prefect database.
        check_run(cfg)
    except (ConfigError, StorageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from flows.progress import continue_hint
    from tasks import reaper

    if _complete(cfg):
        # Nothing to run: answer without a Prefect server, Ray or the lease.
        print(
            f"nothing to do: run {cfg.run.name!r} is complete ({_committed(cfg)} iterations "
            f"committed, run.iterations={cfg.run.iterations})"
        )
        print(continue_hint(args.config, args.set, _committed(cfg), plain=args.plain))
        return 0

    # Before anything starts a process (Prefect's temporary server, a local Ray
    # cluster): whatever this run starts ends with it, even after a SIGKILL.
    reaper.guard()
    if args.plain:
        from flows.driver import run_plain
        from flows.progress import summary

        ctx, rows, seconds = run_plain(cfg)
        print(summary(rows, ctx.store.url, ctx.store.committed_versions(), seconds))
        print(continue_hint(args.config, args.set, _committed(cfg), plain=True))
        return 0
    from flows.config import parse_override
    from flows.rl_training import rl_training

    overrides = dict(parse_override(item) for item in args.set)
    state = rl_training(
        config_path=args.config,
        overrides=overrides,
        force_lease=args.force,
        return_state=True,
    )
    if not state.is_completed():
        return 1
    print(continue_hint(args.config, args.set, _committed(cfg)))
    return 0


def _complete(cfg: RunConfig) -> bool:
    """True when iteration ``run.iterations`` is committed (its ``iteration`` record,
    the last commit of an iteration; iterations commit in order)."""
    from storage.run_store import RunStore

    last = cfg.run.iterations
    return (
        last == 0 or RunStore(cfg.storage, cfg.run.name).read_record(last, "iteration") is not None
    )


def _committed(cfg: RunConfig) -> int:
    """Iterations the run has committed (its metrics rows)."""
    from storage.run_store import RunStore

    return len(RunStore(cfg.storage, cfg.run.name).read_metrics())


def _runs(args: argparse.Namespace) -> int:
    from storage.config import S3Options, StorageConfig
    from storage.errors import StorageError
    from storage.runs import list_runs, table

    try:
        cfg = StorageConfig(root=args.root, s3=S3Options(endpoint_url=args.s3_endpoint_url))
        print(table(list_runs(cfg)))
    except (StorageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _materialize(args: argparse.Namespace) -> int:
    from storage.config import S3Options, StorageConfig
    from storage.errors import StorageError
    from storage.run_store import RunStore

    try:
        cfg = StorageConfig(root=args.root, s3=S3Options(endpoint_url=args.s3_endpoint_url))
        store = RunStore(cfg, args.run)
        adapter = store.read_manifest(args.version).adapter is not None
        if adapter and not args.adapter_only:  # merged into its base: a plain HF folder
            from training.export import merge_adapter

            out, what = merge_adapter(store, args.version, args.dir), "merged into its base"
        else:
            out = store.materialize(args.version, args.dir)
            what = "as its peft adapter folder" if adapter else "as a full HF folder"
    except (StorageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"v{args.version} of run {args.run!r} {what} (verified) in {out}")
    return 0


def _tiny_model(args: argparse.Namespace) -> int:
    if args.shape == "qwen2-0.5b":
        from training.qwen2_shape import write_qwen2_05b

        out = write_qwen2_05b(args.dir, seed=args.seed)
    else:
        from training.tiny_model import write_tiny_model

        out = write_tiny_model(args.dir, seed=args.seed)
    print(f"wrote the {args.shape} model (random init) and the tiny tokenizer to {out}")
    return 0


def _import_model(args: argparse.Namespace) -> int:
    # `import-model NAME [DIR]` or `import-model --gguf FILE DIR`.
    from training.model_import import ModelImportError, import_gguf
    from training.model_packages import PACKAGED_MODELS, import_packaged

    try:
        if args.gguf:
            if args.name is None or args.dir is not None:
                raise ModelImportError("give one folder to write: import-model --gguf FILE DIR")
            out = import_gguf(args.gguf, args.name)
        elif args.name is None:
            raise ModelImportError(
                f"name a packaged model ({', '.join(PACKAGED_MODELS)}) or give --gguf FILE DIR"
            )
        else:
            out = import_packaged(args.name, args.dir)
    except ModelImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"model in {out}; use it with --set model.path={out}")
    return 0


def _serve_engine(args: argparse.Namespace) -> int:
    from engines.embedded.serve import serve_model

    try:
        serve_model(
            args.model,
            host=args.host,
            port=args.port,
            weight_version=args.weight_version,
            api_key=args.api_key or os.environ.get("PREFECT_RL_ENGINE_API_KEY") or None,
            allowed_roots=tuple(args.allowed_root),
            gpu=args.gpu,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from flows.config import ConfigError
    from flows.evaluation import EvaluateParams, evaluate_versions, plan_evaluation
    from storage.errors import StorageError

    try:
        params = EvaluateParams(
            run_name=args.run,
            storage_root=args.root,
            s3_endpoint_url=args.s3_endpoint_url,
            versions=args.versions,
            dataset=args.dataset,
            size=args.size,
            n_samples=args.n_samples,
            temperature=args.temperature,
            shard_size=args.shard_size,
            num_engines=args.engines,
            shard_cpus=args.shard_cpus,
            shard_retries=args.retries,
            ray_address=args.ray_address,
        )
        # Before the flow run: a missing version or run is refused with no flow run,
        # Ray cluster or engine started.
        plan = plan_evaluation(params)
        if plan.ctx.cfg.ray.address is None:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback only, as `run`
    except (ConfigError, StorageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from tasks import reaper

    reaper.guard()  # a local cluster or temporary server this starts ends with it
    state = evaluate_versions(**params.model_dump(), return_state=True)
    if not state.is_completed():
        print(f"error: {state.message}", file=sys.stderr)
        return 1
    out = state.result()
    k = out["scores"][0]["n_samples"]
    print(f"{'version':>7}  pass@1 greedy  pass@1  pass@{k:<3} mean reward  tokens")
    for row in out["scores"]:
        print(
            f"{row['version']:>7}  {row['pass_at_1_greedy']:>13.3f}  {row['pass_at_1']:>6.3f}  "
            f"{row['pass_at_k']:>7.3f}  {row['reward_mean']:>11.3f}  {row['response_tokens']:>6}"
        )
    print(f"record: {out['record']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    set_prefect_defaults()  # before any command imports Prefect
    parser = argparse.ArgumentParser(prog="prefect-rl", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run (or continue) an RL training run")
    run.add_argument("config", help="YAML config, e.g. configs/tiny-cpu.yaml")
    run.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a key"
    )
    run.add_argument(
        "--force", action="store_true", help="take over the run's lease from a dead holder"
    )
    run.add_argument("--plain", action="store_true", help="plain-Python driver, without Prefect")
    run.set_defaults(fn=_run)
    tiny = sub.add_parser("tiny-model", help="write the tiny model and tokenizer to DIR")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--shape",
        choices=["tiny", "qwen2-0.5b"],
        default="tiny",
        help="tiny Llama (default) or Qwen2.5-0.5B's shape (~494M parameters, bf16)",
    )
    tiny.set_defaults(fn=_tiny_model)
    runs = sub.add_parser("runs", help="list the runs under a storage root and their state")
    runs.add_argument("root", nargs="?", default="runs", help="storage.root (default: runs)")
    runs.add_argument("--s3-endpoint-url", default=None, help="storage.s3.endpoint_url")
    runs.set_defaults(fn=_runs)
    mat = sub.add_parser(
        "materialize",
        help="write a weight version as a full HF folder (a delta rebuilt, an adapter "
        "merged into its base)",
    )
    mat.add_argument("run", help="run name")
    mat.add_argument("version", type=int, help="weight version, e.g. 12")
    mat.add_argument("dir", help="new folder to write")
    mat.add_argument("--root", default="runs", help="storage.root (default: runs)")
    mat.add_argument("--s3-endpoint-url", default=None, help="storage.s3.endpoint_url")
    mat.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA adapter version: write its peft folder as is instead of merging it "
        "into its base",
    )
    mat.set_defaults(fn=_materialize)
    imp = sub.add_parser(
        "import-model",
        help="write an HF checkpoint of a packaged model (smollm2-135m-instruct) or a GGUF file",
    )
    imp.add_argument("name", nargs="?", help="packaged model name (with --gguf: the folder)")
    imp.add_argument("dir", nargs="?", help="folder to write (default ~/.cache/prefect-rl/NAME)")
    imp.add_argument("--gguf", metavar="FILE", help="convert this GGUF file instead")
    imp.set_defaults(fn=_import_model)
    serve = sub.add_parser(
        "serve-engine", help="serve one embedded engine over SGLang's HTTP API (no Ray)"
    )
    serve.add_argument("--model", required=True, help="local HF model dir")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--weight-version", default="0")
    serve.add_argument(
        "--api-key", default=None, help="admin bearer token (default: $PREFECT_RL_ENGINE_API_KEY)"
    )
    serve.add_argument(
        "--allowed-root",
        action="append",
        default=[],
        metavar="DIR",
        help="dir weight reloads may load from (repeatable; the model dir always is)",
    )
    serve.add_argument("--gpu", action="store_true", help="run on CUDA if available")
    serve.set_defaults(fn=_serve_engine)
    ev = sub.add_parser(
        "evaluate", help="score published versions of a run (the evaluate-versions flow)"
    )
    ev.add_argument("run", help="run name")
    ev.add_argument("--root", default="runs", help="storage.root (default: runs)")
    ev.add_argument("--s3-endpoint-url", default=None, help="storage.s3.endpoint_url")
    ev.add_argument("--versions", default="newest 2", help="'1,3,5', '2..6', 'newest N' or 'all'")
    ev.add_argument("--dataset", default=None, help="builtin task or .jsonl/.parquet file")
    ev.add_argument("--size", type=int, default=64, help="prompts (a file: its first rows)")
    ev.add_argument("--n-samples", type=int, default=4, help="sampled answers per prompt (k)")
    ev.add_argument("--temperature", type=float, default=1.0)
    ev.add_argument("--shard-size", type=int, default=16, help="prompts per shard task")
    ev.add_argument("--engines", type=int, default=1, help="engines the evaluation starts")
    ev.add_argument("--shard-cpus", type=float, default=1.0, help="CPUs per shard task")
    ev.add_argument("--retries", type=int, default=2, help="retries of a failed shard")
    ev.add_argument("--ray-address", default=None, help="default: the run's ray.address")
    ev.set_defaults(fn=_evaluate)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
