"""One engine over its HTTP protocol (the same for embedded and SGLang engines):
where it may load weights from, its client, the version it serves, and a weight
update bracketed by pause and continue, from a folder (``disk_reload``) or pushed
from the trainer (``push_update``), each part timed in the step's ``phases``.
An engine continues with its allocator's cache kept unless it shares its devices
with the trainer: SGLang's default (``torch_empty_cache``) hands every cached block
back to the driver at each continue, and the next rollout allocates them again.

Which version an engine must serve, and by which transport, is decided above
this module (``tasks.serving.transports``), which calls it; it calls nothing of
the package back.
"""

from __future__ import annotations

import logging
import os

import ray

from tasks import colocate
from tasks.phases import phase

log = logging.getLogger("prefect_rl.engines")


def cache_dir(ctx) -> str:
    """The engines' cache of this run, as each engine node resolves it ('~' there)."""
    base = ctx.cfg.engines.local_cache_dir or "~/.cache/prefect-rl"
    return os.path.join(base, ctx.run_name, "weights")


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
    """The version engine ``engine_id`` reports on /model_info, or in a LoRA run the
    newest adapter version ``/v1/models`` lists (SGLang keeps several loaded beside
    its base, whose version stays 0); None if it is down."""
    if group.handle(engine_id) is None:
        return None
    try:
        with engine_client(ctx, group, engine_id) as client:
            if ctx.cfg.train.lora is not None:
                loaded = _adapter_versions(client)
                if loaded:
                    return str(max(loaded))
            return client.get_weight_version()
    except (
        ray.exceptions.RayActorError,
        ray.exceptions.GetTimeoutError,
        OSError,
        RuntimeError,
    ) as e:
        log.warning("engine %d does not answer: %s", engine_id, e)
        return None


def disk_reload(ctx, group, engine_id: int, v: int, path: str) -> None:
    """Pause, /update_weights_from_disk of ``path`` on the engine's node (flushing every
    flush_cache_interval versions), continue."""
    flush = v % ctx.cfg.weights.flush_cache_interval == 0
    with engine_client(ctx, group, engine_id) as client:
        with phase("pause"):
            client.pause_generation(ctx.cfg.engines.pause_mode)
        try:
            with phase("load"):
                reply = client.update_weights_from_disk(
                    path, weight_version=str(v), flush_cache=flush
                )
        finally:
            with phase("continue"):
                client.continue_generation(torch_empty_cache=colocate.colocated(ctx))
    if not reply.get("success"):
        raise RuntimeError(f"engine {engine_id} refused v{v} from {path}: {reply.get('message')}")


def _adapter_versions(client) -> dict[int, str]:
    """version -> name of every adapter version ``/v1/models`` lists (the first card is
    the base model; names other than ``v{k}`` are not the run's)."""
    from wire.lora import version_of

    out = {}
    for name in client.models()[1:]:
        try:
            out[version_of(name)] = name
        except ValueError:
            continue
    return out


def unload_stale(ctx, client, v: int) -> list[str]:
    """Before adapter v loads: unload the adapter versions older than any rollout may
    still sample from (v - max_staleness - 1), so v takes a free slot and memory never
    creeps (SGLang keeps an adapter until asked; its unload waits for the requests
    that use it). Returns the names unloaded."""
    oldest = v - ctx.cfg.rollout.max_staleness - 1
    stale = [name for k, name in sorted(_adapter_versions(client).items()) if k < oldest]
    for name in stale:
        client.unload_lora_adapter(name)
    return stale


def adapter_reload(ctx, group, engine_id: int, v: int, path: str) -> None:
    """Pause, /load_lora_adapter of the adapter folder ``path`` as ``v{v}`` (stale
    versions unloaded first), continue. A name the engine lists on /v1/models already
    is not loaded again (SGLang refuses a name twice; versions are immutable)."""
    from wire.lora import adapter_name

    name = adapter_name(v)
    with engine_client(ctx, group, engine_id) as client:
        with phase("pause"):
            client.pause_generation(ctx.cfg.engines.pause_mode)
        try:
            with phase("unload"):
                unload_stale(ctx, client, v)
            with phase("load"):
                if name not in client.models():
                    reply = client.load_lora_adapter(name, path)
                    if not reply.get("success"):
                        raise RuntimeError(
                            f"engine {engine_id} refused adapter {name} from {path}: "
                            f"{reply.get('message') or reply.get('error_message')}"
                        )
        finally:
            with phase("continue"):
                client.continue_generation(torch_empty_cache=colocate.colocated(ctx))


def push_update(ctx, group, trainer, engine_id: int, v: int) -> dict:
    """Pause (in place), push trainer state v over the in-memory transport, continue.
    The cache is flushed with the last bucket every flush_cache_interval versions.

    The engine is controlled the way every reload controls it, through its
    SGLang HTTP client (pause, the update session, continue); only the weights
    themselves travel from the trainer to the engine actor over Ray."""
    w = ctx.cfg.weights
    flush = v % w.flush_cache_interval == 0
    with engine_client(ctx, group, engine_id) as client:
        with phase("pause"):
            client.pause_generation(ctx.cfg.engines.pause_mode)
        try:
            with phase("session"):
                session = _begin_update_session(client)
            if ctx.cfg.train.lora is not None:
                with phase("unload"):
                    unload_stale(ctx, client, v)
            with phase("push"):
                out = trainer.push_weights(
                    group.handle(engine_id),
                    w.transport,
                    w.bucket_bytes,
                    flush,
                    group_name=f"{ctx.run_name}-wu-e{engine_id}",
                )
            if session:
                client.end_weight_update()
        finally:
            with phase("continue"):
                client.continue_generation(torch_empty_cache=colocate.colocated(ctx))
    return out


def _begin_update_session(client) -> bool:
    """Open a weight-update session; False where the server has none (SGLang before
    0.5.23 answers 404): pause and continue bracket the update alone there."""
    from engines.client import EngineHTTPError

    try:
        client.begin_weight_update()
    except EngineHTTPError as e:
        if e.status != 404:
            raise
        return False
    return True
