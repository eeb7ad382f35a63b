"""Preparing a run: base model, lease, run.json, v0 and the Ray connection.

Called once at the start of ``rl_training`` (and by the plain driver). It is
idempotent: on a resumed run it checks what exists instead of rewriting it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import ray

from flows.config import ConfigError, RunConfig
from tasks.context import RunContext

log = logging.getLogger("prefect_rl.prepare")

# Settings a continued run must keep: changing them would silently change what
# earlier iterations meant (other prompts, other seeds, another model).
FROZEN_KEYS = (
    "run.seed",
    "model.path",
    "rollout.task",
    "rollout.reward",
    "rollout.batch_size",
    "rollout.n_samples_per_prompt",
    "train.backend",
    "train.num_workers",
)


def base_model_path(cfg: RunConfig) -> str:
    """The local HF directory of v0: model.path, or the tiny model built offline."""
    if cfg.model.path:
        p = Path(cfg.model.path).expanduser()
        if not (p / "config.json").is_file():
            raise ConfigError(
                f"model.path {str(p)!r} is not a local HF checkpoint (no config.json); "
                "give a directory written by save_pretrained, or leave model.path unset for the tiny model"
            )
        return str(p.resolve())
    from training.tiny_model import write_tiny_model

    out = Path(os.path.expanduser("~/.cache/prefect-rl")) / f"tiny-model-seed{cfg.run.seed}"
    if not (out / "model.safetensors").is_file():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        write_tiny_model(tmp, seed=cfg.run.seed)
        os.replace(tmp, out) if not out.exists() else None
    return str(out)


def code_version() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _get(d: dict, dotted: str):
    for key in dotted.split("."):
        d = d.get(key, {}) if isinstance(d, dict) else {}
    return d if d != {} else None


def check_or_write_run_json(ctx: RunContext) -> None:
    store, cfg = ctx.store, ctx.cfg
    snapshot = cfg.model_dump(mode="json")
    existing = store.read_run_json()
    if existing is None:
        store.write_run_json(
            {
                "config": snapshot,
                "code_version": code_version(),
                "created_at": datetime.now(timezone.utc).isoformat(),
            }
        )
        return
    old = existing.get("config", {})
    changed = [k for k in FROZEN_KEYS if _get(old, k) != _get(snapshot, k)]
    if changed:
        raise ConfigError(
            f"run {cfg.run.name!r} in {store.url} was started with other settings for "
            + ", ".join(f"{k} (was {_get(old, k)!r}, now {_get(snapshot, k)!r})" for k in changed)
            + "; keep them, or start a new run with another run.name"
        )


def publish_base(ctx: RunContext) -> None:
    """v0 is the base model, published like any other version."""
    store = ctx.store
    if 0 in store.committed_versions():
        return
    writer = store.weights_writer(0, iteration=0, parent=None)
    base = Path(ctx.base_model_path)
    for f in sorted(base.iterdir()):
        if f.is_file():
            writer.add_file(f.name, str(f))
    writer.commit()


def connect_ray(cfg: RunConfig) -> None:
    if ray.is_initialized():
        return
    kwargs = {"namespace": cfg.ray.namespace, "include_dashboard": False, "log_to_driver": False}
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, **kwargs)
        return
    # A local cluster. Logical CPUs: actors reserve their bundles, and the Prefect
    # tasks running as Ray tasks need room beside them on a 2-core machine.
    need = (
        cfg.engines.num_engines * cfg.engines.tp_size * cfg.engines.num_cpus_per_engine
        + cfg.train.num_workers * cfg.train.num_cpus_per_worker
    )
    # address="local": never join a cluster someone else started on this machine.
    ray.init(address="local", num_cpus=cfg.ray.num_cpus or int(need) + 4, **kwargs)


def prepare_run(cfg: RunConfig, force_lease: bool = False) -> RunContext:
    ctx = RunContext(cfg=cfg, base_model_path=base_model_path(cfg))
    ctx.store.acquire_lease(ctx.owner, cfg.storage.lease_ttl_s, force=force_lease)
    check_or_write_run_json(ctx)
    publish_base(ctx)
    connect_ray(cfg)
    return ctx


def config_digest(cfg: RunConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]
