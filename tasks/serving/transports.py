"""How weights reach the engines, chosen by ``weights.transport``, and bringing one
engine to the version it must serve that way (colocated: in the device state
``tasks.colocate`` defines for a weight update): where a version's files are on an
engine's node, a dead engine restarted, a reload from disk or a push from the
trainer. Speaking to one engine is ``tasks.serving.engine``'s and which version is
published ``tasks.serving.versions``'; this module calls both, and neither calls it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from tasks import colocate
from tasks.phases import phase
from tasks.serving.engine import (
    adapter_reload,
    cache_dir,
    disk_reload,
    push_update,
    served_version,
)
from tasks.serving.versions import adapter_base, ensure_published, newest_published

log = logging.getLogger("prefect_rl.engines")


class Transport:
    """How weights reach the engines, chosen by ``weights.transport``.

    The base is the disk path: engines reload from a version folder (local, or a
    verified pull into the engines' cache). In-memory transports push trainer
    state instead and still publish every ``weights.publish_interval``."""

    name: ClassVar[str] = "disk"
    pushes: ClassVar[bool] = False  # trainer state k goes straight to the engines

    def version_after(self, ctx, k: int) -> int:
        """The version engines serve after iteration k (read-only: nothing is republished)."""
        return k if self.pushes else newest_published(ctx, k)

    def serve(self, ctx, group, engine_id: int, v: int, force: bool) -> Served:
        """Bring engine ``engine_id`` to version v; what it took."""
        return disk_engine_serves(ctx, group, engine_id, v, force)

    def revive(self, ctx, group, engine_id: int, v: int) -> None:
        """Restart the dead engine ``engine_id`` on version v."""
        start_on(ctx, group, engine_id, v)


class DiskTransport(Transport):
    name = "disk"


class ObjectStoreTransport(Transport):
    name = "object-store"  # the same reload: ``engine_weights`` pulls on the engine's node


class TensorTransport(Transport):
    name = "tensor"  # bucketed hand-off: shared memory on CPU, CUDA IPC on GPU
    pushes = True

    def serve(self, ctx, group, engine_id: int, v: int, force: bool) -> Served:
        return push_engine_serves(ctx, group, engine_id, v, force)

    def revive(self, ctx, group, engine_id: int, v: int) -> None:
        push_engine_serves(ctx, group, engine_id, v)  # restarted from disk, then pushed


class DistributedTransport(TensorTransport):
    name = "distributed"  # broadcast over gloo/NCCL


TRANSPORTS: dict[str, Transport] = {
    t.name: t()
    for t in (DiskTransport, ObjectStoreTransport, TensorTransport, DistributedTransport)
}


def transport_for(ctx) -> Transport:
    """The transport the run's ``weights.transport`` names."""
    name = ctx.cfg.weights.transport
    if name not in TRANSPORTS:
        raise ValueError(f"weights.transport {name!r} is unknown; use one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[name]


def target_version(ctx, k: int) -> int:
    """The version engines serve after iteration k: k itself with an in-memory
    transport (trainer state k is pushed), else the newest published one <= k,
    made readable again if it was damaged (``ensure_published``)."""
    v = transport_for(ctx).version_after(ctx, k)
    if not transport_for(ctx).pushes:
        ensure_published(ctx, v)
    return v


@dataclass(frozen=True)
class Weights:
    """Where engine ``engine_id`` reads version v from."""

    path: str  # a directory on the engine's node
    pull: dict[str, Any] | None  # the node-cache pull (storage.Pulled + node); None: none


@dataclass(frozen=True)
class Served:
    """What bringing one engine to a version did; ``recorded`` goes into its step result."""

    memory: colocate.Memory | None  # colocated: the device states it left
    pull: dict[str, Any] | None = None  # the node-cache pull, if the version was read from one
    push: dict[str, Any] | None = None  # an in-memory push: path, signal, bytes, seconds

    def recorded(self) -> dict[str, Any]:
        extra = {k: v for k, v in (("pull", self.pull), ("push", self.push)) if v}
        return {**colocate.recorded(self.memory), **extra}


def engine_weights(ctx, group, engine_id: int, v: int) -> Weights:
    """Version v on the engine's node: the version folder itself on a local root
    every node sees (``tasks.cluster.check_shared_root``), else a verified pull into
    the local cache of the node the engine sits on (one copy per node)."""
    local = ctx.store.local_version_dir(v)
    if local is not None and ctx.cfg.engines.local_cache_dir is None:
        return Weights(local, None)
    pulled = group.pull(engine_id, ctx.cfg.storage, v, cache_dir(ctx))
    return Weights(pulled["path"], pulled)


def start_on(ctx, group, engine_id: int, v: int, weights: Weights | None = None) -> None:
    """(Re)start engine ``engine_id`` on version v from its files (``weights``: v's,
    when the caller has them); no serving record. An adapter version starts the engine
    on its base, then loads the adapter."""
    weights = weights or engine_weights(ctx, group, engine_id, v)
    base = adapter_base(ctx, v)
    with phase("start"):  # the engine's start, ready to serve
        if base is None:
            group.restart(engine_id, weights.path, v)
            return
        group.restart(engine_id, engine_weights(ctx, group, engine_id, base).path, base)
    adapter_reload(ctx, group, engine_id, v, weights.path)


def reload_on(ctx, group, engine_id: int, v: int, path: str) -> None:
    """Engine ``engine_id`` (alive) loads version v from the folder ``path``: full
    weights by /update_weights_from_disk, an adapter by /load_lora_adapter."""
    if adapter_base(ctx, v) is None:
        disk_reload(ctx, group, engine_id, v, path)
    else:
        adapter_reload(ctx, group, engine_id, v, path)


def ensure_engine_serves(ctx, group, engine_id: int, v: int, force_reload: bool = False) -> Served:
    """Bring engine ``engine_id`` to version v the run's transport's way
    (``transport_for``). Loading a version twice is harmless.

    Colocated, ``Served.memory`` holds the device states it leaves (``tasks.colocate``)."""
    return transport_for(ctx).serve(ctx, group, engine_id, v, force_reload)


def disk_engine_serves(ctx, group, engine_id: int, v: int, force_reload: bool = False) -> Served:
    """Disk and object-store transports: restart a dead engine on v, else pause,
    /update_weights_from_disk, continue (see ``disk_reload``)."""
    weights = engine_weights(ctx, group, engine_id, v)
    # Trainer asleep before the engine wakes; the health check below runs a forward.
    memory = colocate.for_update(ctx, engine_id, push=False)
    if not group.is_alive(engine_id):
        if group.ran_before(engine_id):  # else its first start: the group logs "starting"
            log.warning("engine %d is not alive; restarting it on v%d", engine_id, v)
        start_on(ctx, group, engine_id, v, weights)
        memory = colocate.for_update(ctx, engine_id, push=False)  # the new one's state
    elif force_reload or served_version(ctx, group, engine_id) != str(v):
        reload_on(ctx, group, engine_id, v, weights.path)
    ctx.store.record_serving(engine_id, v)
    return Served(memory, weights.pull)


def push_engine_serves(ctx, group, engine_id: int, v: int, force: bool = False) -> Served:
    """In-memory transports: bring engine ``engine_id`` to version v by pushing
    trainer state v into it. A dead engine is first restarted on the newest
    committed version <= v from disk; a version already on disk that the trainer
    no longer holds is loaded from disk (as the disk transport does).

    Colocated, ``Served.memory`` holds the device states it leaves (``tasks.colocate``)."""
    committed = [c for c in ctx.store.committed_versions() if c <= v]
    memory = colocate.wake_engine(ctx, engine_id)  # the health check runs a forward
    with phase("alive"):
        alive = group.is_alive(engine_id)
    if not alive:
        base = max(committed)
        if group.ran_before(engine_id):  # else its first start: the group logs "starting"
            log.warning(
                "engine %d is not alive; restarting it on v%d, then pushing v%d", engine_id, base, v
            )
        colocate.for_update(ctx, engine_id, push=False)  # room for the new engine
        start_on(ctx, group, engine_id, base)
        memory = colocate.wake_engine(ctx, engine_id)  # the new one's state
    push = None
    with phase("served"):
        current = served_version(ctx, group, engine_id)
    if force or current != str(v):
        trainer = ctx.trainer()
        with phase("state"):
            from_disk = v in committed and trainer.iteration() != v
        if from_disk:
            memory = colocate.for_update(ctx, engine_id, push=False)
            reload_on(ctx, group, engine_id, v, engine_weights(ctx, group, engine_id, v).path)
        else:
            with phase("state"):
                trainer.ensure_state(v, ctx.base_model_path)
            # Both sides hold the weights while they move; re-created ranks start awake.
            memory = colocate.for_update(ctx, engine_id, push=True)
            out = push_update(ctx, group, trainer, engine_id, v)
            push = {
                k: out[k]
                for k in ("path", "signal", "bound", "bytes", "buckets", "s")
                if k in (out or {})
            }
    with phase("record"):
        ctx.store.record_serving(engine_id, v)
    return Served(memory, push=push)
