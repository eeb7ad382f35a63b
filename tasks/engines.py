"""Ray glue between the steps and the engine group: which version engines must
serve, where its files are, and bringing one engine to that version."""

from __future__ import annotations

import logging
import os

import ray

log = logging.getLogger("prefect_rl.engines")


def expected_version(ctx, k: int) -> int:
    """The version rollout k must be generated with: the newest committed one <= k-1."""
    versions = [v for v in ctx.store.committed_versions() if v <= k - 1]
    if not versions:
        raise RuntimeError(
            f"no committed weights version <= {k - 1} in {ctx.store.url}; "
            "v0 is published when a run is prepared: run `prefect-rl run` on this run first"
        )
    return max(versions)


def cache_dir(ctx) -> str:
    base = ctx.cfg.engines.local_cache_dir or os.path.expanduser("~/.cache/prefect-rl")
    return os.path.join(base, ctx.run_name, "weights")


def version_path(ctx, v: int) -> str:
    """A local directory holding version v: the version folder itself on local
    disk, else a verified pull into the engines' local cache."""
    local = ctx.store.local_version_dir(v)
    if local is not None and ctx.cfg.engines.local_cache_dir is None:
        return local
    return ctx.store.pull_version(v, cache_dir(ctx))


def kill_engine(group, engine_id: int) -> None:
    handle = group.handle(engine_id)
    if handle is not None:
        ray.kill(handle, no_restart=True)


def allowed_roots(ctx) -> list[str]:
    """Where engines may load weights from: the run's local version folders and the cache."""
    roots = [os.path.dirname(cache_dir(ctx))]
    local = ctx.store.local_version_dir(0)
    if local is not None:
        roots.append(os.path.dirname(local))
    return roots


def engine_client(ctx, group, engine_id: int):
    """The SGLang HTTP client of one engine; starts its HTTP server if it has none.

    Reload and verify speak the same HTTP protocol to embedded and SGLang engines.
    """
    if engine_id not in group.urls():
        group.start_http(allowed_roots=allowed_roots(ctx))
    return group.client(engine_id)


def served_version(ctx, group, engine_id: int) -> str | None:
    """The version engine ``engine_id`` reports on /model_info; None if it is down."""
    if group.handle(engine_id) is None:
        return None
    try:
        with engine_client(ctx, group, engine_id) as client:
            return client.get_weight_version()
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, OSError, RuntimeError) as e:
        log.warning("engine %d does not answer: %s", engine_id, e)
        return None


def ensure_engine_serves(ctx, group, engine_id: int, v: int, force_reload: bool = False) -> None:
    """Bring engine ``engine_id`` to version v over its HTTP API: restart it if
    dead, else pause, update from disk, continue. Loading a version twice is harmless."""
    path = version_path(ctx, v)
    if not group.is_alive(engine_id):
        log.warning("engine %d is not alive; restarting it on v%d", engine_id, v)
        group.restart(engine_id, path, v)
    elif force_reload or served_version(ctx, group, engine_id) != str(v):
        flush = v % ctx.cfg.weights.flush_cache_interval == 0
        with engine_client(ctx, group, engine_id) as client:
            client.pause_generation(ctx.cfg.engines.pause_mode)
            try:
                reply = client.update_weights_from_disk(path, weight_version=str(v), flush_cache=flush)
            finally:
                client.continue_generation()
        if not reply.get("success"):
            raise RuntimeError(f"engine {engine_id} refused v{v} from {path}: {reply.get('message')}")
    ctx.store.record_serving(engine_id, v)


def kill_train_rank0(trainer) -> None:
    actors = trainer.actors()
    if actors:
        ray.kill(actors[0], no_restart=True)
