"""The ``prefect-rl`` command line."""

from __future__ import annotations

import argparse
import os
import sys


def _run(args: argparse.Namespace) -> int:
    from flows.config import ConfigError, load_config
    from storage.errors import StorageError

    try:
        cfg = load_config(args.config, args.set)
        if cfg.ray.address is None:
            # Only the run's own local cluster, which binds loopback alone
            # (tasks.prepare.start_local_ray), goes without auth. A cluster at
            # ray.address keeps the user's RAY_AUTH_MODE (token: see README).
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        from tasks.prepare import check_run

        # Before rl_training: a refused config creates no flow run, so nothing
        # of it (a secret in a URL, say) reaches the Prefect database.
        check_run(cfg)
    except (ConfigError, StorageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plain:
        from flows.driver import run_plain
        from flows.progress import summary

        ctx, rows, seconds = run_plain(cfg)
        print(summary(rows, ctx.store.url, ctx.store.committed_versions(), seconds))
        return 0
    from flows.config import parse_override
    from flows.rl_training import TrainingParams, rl_training

    overrides = dict(parse_override(item) for item in args.set)
    state = rl_training(
        TrainingParams(config_path=args.config, overrides=overrides, force_lease=args.force),
        return_state=True,
    )
    return 0 if state.is_completed() else 1


def _tiny_model(args: argparse.Namespace) -> int:
    from training.tiny_model import write_tiny_model

    out = write_tiny_model(args.dir, seed=args.seed)
    print(f"wrote the tiny model and tokenizer to {out}")
    return 0


def _serve_engine(args: argparse.Namespace) -> int:
    from engines.http_server import serve_model

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


def main(argv: list[str] | None = None) -> int:
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
    tiny.set_defaults(fn=_tiny_model)
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
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
