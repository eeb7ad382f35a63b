"""Driver-side handle on the train ranks (slime's RayTrainGroup, made recoverable).

Owns the Ray side of training: one detached placement group
``{run}/train-pg`` (one bundle per rank, PACK) or, colocated, bundle ``rank``
of the run's shared group (``actors.placement``, never removed here), detached
named actors ``{run}/train/{rank}`` in the run's Ray namespace, and
``ensure_state(k)``, the recovery primitive. Holds only names and config, so
it pickles into any task; handles are looked up by name on every call. Never
generates rollouts (replay uses the persisted ones) and never imports Prefect.
Every wait on the ranks ends by ``call_timeout_s`` (the step's deadline, given
by the group's owner) with a ``CallTimeout`` naming the ranks and the call.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import ray
from ray._raylet import PlacementGroupID
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors import deadline
from actors.history import ran_before
from actors.placement import SharedPlacement, pinned, unplaceable
from training.actor import TrainActor
from training.config import RunIdentity, TrainerSections

log = logging.getLogger(__name__)
# How long a new train placement group may wait for resources before the step
# fails with a message (rather than hanging while other actors hold the CPUs).
PG_READY_TIMEOUT_S = 120.0


@ray.remote(num_cpus=0)
def _master_endpoint() -> tuple[str, int]:
    """IP and a free port on the node of bundle 0, where rank 0 will run."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


_BUILD_LOCKS: dict[str, threading.Lock] = {}
_BUILD_LOCKS_GUARD = threading.Lock()


def _building(rank0: str) -> threading.Lock:
    """The lock of one group's ``ensure_state`` in this process (keyed by its rank 0's
    actor name): a new run starts building its trainer ahead of ``train[1]``
    (``tasks.steps.build_trainer_ahead``), and the step's own call must wait for
    that build rather than release the ranks it is creating and start again."""
    with _BUILD_LOCKS_GUARD:
        return _BUILD_LOCKS.setdefault(rank0, threading.Lock())


@functools.cache
def _remote_class(cls: type[TrainActor]) -> Any:
    """``cls`` as a Ray actor class, built once per class: Ray exports a class to the
    cluster once per class object, and each export disassembles the whole class
    (~20 ms of CPU), which a new wrapper per group creation would pay every time."""
    return ray.remote(cls)


def actor_class(backend: str) -> type[TrainActor]:
    """The train-actor class of ``train.backend``; megatron-core is imported only when chosen."""
    if backend == "megatron":
        from training.megatron.actor import MegatronTrainActor

        return MegatronTrainActor
    return TrainActor


class TrainGroup:
    def __init__(
        self,
        identity: RunIdentity,
        sections: TrainerSections,
        *,
        placement: SharedPlacement | None,
        fence: int | None,
        call_timeout_s: float | None = None,
    ) -> None:
        """``placement`` is required (None when disaggregated) so a colocated caller
        cannot forget it and have the ranks take devices of their own. ``fence`` is
        the caller's lease fence (None for readers): every checkpoint and weights
        commit of the ranks checks it, so a writer that lost the lease cannot commit."""
        sections = self._own_sections(sections)
        self.identity, self.sections = identity, sections
        self.run_name, self.seed, self.namespace = identity.name, identity.seed, identity.namespace
        self.train_cfg, self.storage_cfg = sections.train, sections.storage
        self.placement = placement  # colocated: the shared group the ranks sit in
        self.fence = fence  # passed with each commit: detached ranks may outlive a writer
        self.call_timeout_s = call_timeout_s  # deadline of each wait on the ranks; None: none

    @property
    def world_size(self) -> int:
        return self.train_cfg.num_workers

    def _own_sections(self, sections: TrainerSections) -> TrainerSections:
        """What this group's ranks are built from (the critic's group: its own resources)."""
        return sections

    @property
    def pg_name(self) -> str:
        return f"{self.run_name}/train-pg"

    def actor_name(self, rank: int) -> str:
        return f"{self.run_name}/train/{rank}"

    # -- lifecycle ---------------------------------------------------------
    def create(self, base_model_path: str) -> None:
        """Fresh ranks at iteration 0 (base weights). Leftovers are released first."""
        self.release()
        cfg = self.train_cfg
        pg = self._placement_group()
        addr, port = self._get(
            _master_endpoint.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, self._bundle(0))
            ).remote(),
            "find rank 0's address",
        )
        remote_cls = _remote_class(self._actor_class())
        actors = [
            remote_cls.options(
                name=self.actor_name(rank),
                namespace=self.namespace,
                lifetime="detached",
                max_restarts=0,  # a restarted rank would hold no state; ensure_state rebuilds
                num_cpus=cfg.num_cpus_per_worker,
                num_gpus=cfg.num_gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, self._bundle(rank)),
            ).remote(self.identity, self.sections, rank, addr, port)
            for rank in range(self.world_size)
        ]
        self._get([a.setup.remote() for a in actors], "setup")
        self._get([a.init_from_base.remote(base_model_path) for a in actors], "init_from_base")

    def _actor_class(self) -> type[TrainActor]:
        """The class of this group's ranks (the critic's group names its own)."""
        return actor_class(self.train_cfg.backend)

    def _store(self) -> Any:  # -> storage.run_store.RunStore
        """Where this group's checkpoints live (the critic's group: under critic/)."""
        from storage.run_store import RunStore

        return RunStore(self.storage_cfg, self.run_name)

    def _placement_group(self) -> PlacementGroup:
        """The shared group when colocated, else a fresh ``{run}/train-pg``."""
        if self.placement is not None:
            return self.placement.ensure(PG_READY_TIMEOUT_S)
        cfg = self.train_cfg
        bundle: dict[str, float] = {"CPU": cfg.num_cpus_per_worker}
        if cfg.num_gpus_per_worker > 0:
            bundle["GPU"] = cfg.num_gpus_per_worker
        bundle = pinned(bundle, cfg.node_resource)  # train.node_resource: its hosts only
        pg = placement_group(
            [dict(bundle) for _ in range(self.world_size)],
            strategy="PACK",
            name=self.pg_name,
            lifetime="detached",  # outlives the task that created it, like the actors
        )
        try:
            ray.get(pg.ready(), timeout=PG_READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise RuntimeError(
                f"the train placement group ({self.world_size} x {bundle}) could not be placed "
                f"within {PG_READY_TIMEOUT_S:.0f}s: {unplaceable(cfg.node_resource)}; or stop "
                "other runs' actors, or lower train.num_workers / train.num_cpus_per_worker"
            ) from None
        return pg

    def _bundle(self, rank: int) -> int:
        return rank if self.placement is None else self.placement.train_bundle(rank)

    def actors(self) -> list[Any]:
        """Handles of all ranks, by name; raises ValueError if one does not exist."""
        return [
            ray.get_actor(self.actor_name(r), namespace=self.namespace)
            for r in range(self.world_size)
        ]

    def _iterations(self, timeout: float = 60.0) -> list[int | None] | None:
        """Iteration of every rank, or None if any rank is missing or dead."""
        try:
            actors = self.actors()
            return ray.get([a.iteration.remote() for a in actors], timeout=timeout)
        except (ValueError, ray.exceptions.RayError) as e:
            log.info("train group %s not alive: %s", self.run_name, type(e).__name__)
            return None

    def alive(self) -> bool:
        return self._iterations() is not None

    def iteration(self) -> int | None:
        """The iteration all ranks hold; None if not alive or the ranks disagree."""
        its = self._iterations()
        if not its or any(i != its[0] for i in its):
            return None
        return its[0]

    def release(self) -> None:
        """Kill every rank and remove the placement group (frees CPUs/GPUs).

        Colocated, the shared group stays: the engines live in it too.
        """
        for r in range(self.world_size):
            try:
                ray.kill(ray.get_actor(self.actor_name(r), namespace=self.namespace))
            except ValueError:
                pass
        for r in range(self.world_size):
            self._wait_gone(self.actor_name(r))
        if self.placement is not None:
            return
        for pg_id, info in ray.util.placement_group_table().items():
            if info.get("name") == self.pg_name and info.get("state") != "REMOVED":
                # Looked up by id, not name: names resolve only in the caller's namespace.
                remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))

    def shutdown(self) -> None:
        """End of run: same as release; the group object stays usable for create().

        Colocated, ``EngineGroup.shutdown`` (called after this one) removes the
        shared group, so engines that outlive the run keep their devices.
        """
        self.release()

    def _wait_gone(self, name: str, timeout: float = 60.0) -> None:
        # A killed actor keeps its name until the GCS marks it dead; a new actor
        # with that name would be refused until then.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                return
            time.sleep(0.05)
        raise TimeoutError(f"actor {name} still registered {timeout}s after ray.kill")

    # -- recovery ----------------------------------------------------------
    def ensure_state(self, k: int, base_model_path: str) -> dict[str, Any]:
        """Make every rank hold trainer state ``k``.

        Normal path (alive, holding k): one ray.get, nothing else. Otherwise
        recreate the ranks, restore the newest committed checkpoint c <= k that
        verifies (older ones if it is corrupt; base weights if none), then
        replay train_step(c+1..k) over the persisted rollouts.

        Returns ``restored_from``, ``replayed``, ``recreated`` and ``warnings``:
        one message per corrupt checkpoint skipped, naming the one used instead.
        The caller shows them (a Ray worker's log is not where a user looks).
        """
        with _building(self.actor_name(0)):  # a second caller waits, then finds state k
            return self._ensure_state(k, base_model_path)

    def _ensure_state(self, k: int, base_model_path: str) -> dict[str, Any]:
        its = self._iterations()
        if its is not None and all(i == k for i in its):
            return {"restored_from": None, "replayed": [], "recreated": False, "warnings": []}
        ranks = [self.actor_name(r) for r in range(self.world_size)]
        if its is None and not ran_before(ranks):  # no fault: a new run or a new cluster
            log.info("starting train group %s for state %d", self.run_name, k)
        else:
            log.warning("train group %s holds %s, needs %d: rebuilding", self.run_name, its, k)
        self.create(base_model_path)
        c, skipped = self._restore_point(k)
        if c > 0:
            self._get([a.load_checkpoint.remote(c) for a in self.actors()], f"load_checkpoint({c})")
        replayed = []
        for j in range(c + 1, k + 1):
            self.train(j)
            replayed.append(j)
        used = f"checkpoint {c}" if c > 0 else "the base weights (no older checkpoint verifies)"
        replay = f" and replayed iterations {c + 1}..{k}" if replayed else ""
        msgs = [
            f"checkpoint {bad} of run {self.run_name!r} is corrupt ({why}); "
            f"restored from {used}{replay} instead"
            for bad, why in skipped
        ]
        for msg in msgs:
            log.warning(msg)
        return {"restored_from": c, "replayed": replayed, "recreated": True, "warnings": msgs}

    def _restore_point(self, k: int) -> tuple[int, list[tuple[int, str]]]:
        """Newest committed checkpoint <= k that verifies (0, base weights, if none)
        and the newer corrupt ones skipped, each with why it failed."""
        from storage.errors import IntegrityError

        store = self._store()
        skipped: list[tuple[int, str]] = []
        for c in sorted((c for c in store.committed_checkpoints() if 0 < c <= k), reverse=True):
            try:
                store.verify_checkpoint(c)
                return c, skipped
            except IntegrityError as e:
                skipped.append((c, str(e)))
        return 0, skipped

    # -- steps -------------------------------------------------------------
    def train(self, k: int) -> dict[str, float]:
        """One step on every rank over rollouts k; rank 0's metrics (already all-reduced)."""
        return self._get([a.train_step.remote(k) for a in self.actors()], f"train_step({k})")[0]

    def save(
        self,
        k: int,
        meta_extra: dict | None = None,
        background: bool = False,
        fail_background: bool = False,
    ) -> dict:
        """Checkpoint k (see ``TrainActor.save_checkpoint``); rank 0's meta."""
        refs = [
            a.save_checkpoint.remote(k, meta_extra, self.fence, background, fail_background)
            for a in self.actors()
        ]
        return self._get(refs, f"save_checkpoint({k})")[0]

    def wait_saved(self) -> list[str]:
        """Wait for background checkpoint writes; the failures they met (warnings)."""
        refs = [a.wait_saved.remote() for a in self.actors()]
        return [w for ws in self._get(refs, "wait_saved()") for w in ws]

    def export_hf(
        self, version: int, iteration: int, parent: int | None, background: bool = False
    ) -> dict:
        """Publish trainer state as ``weights/v{version}`` (see ``TrainActor.export_hf``)."""
        refs = [
            a.export_hf.remote(version, iteration, parent, self.fence, background)
            for a in self.actors()
        ]
        return self._get(refs, f"export_hf(v{version})")[0]

    def _get(self, refs: Any, call: str) -> Any:
        """``ray.get`` of one call on the ranks (a list: one ref per rank) by the deadline."""
        names = (
            [self.actor_name(r) for r in range(len(refs))]
            if isinstance(refs, list)
            else f"{self.run_name}/train"
        )
        return deadline.get(refs, self.call_timeout_s, call, names)

    def push_weights(
        self,
        engine: Any,
        transport: str,
        bucket_bytes: int,
        flush_cache: bool,
        group_name: str = "",
    ) -> dict:
        """Send the state the ranks hold to one engine actor (in-memory transports);
        rank 0's summary."""
        bucket = bucket_bytes
        refs = [
            a.push_weights.remote(engine, transport, bucket, flush_cache, group_name)
            for a in self.actors()
        ]
        return self._get(refs, f"push_weights({transport})")[0]

    def offload(self) -> list[dict[str, Any]]:
        """Every rank sleeps (frees its device for colocated engines); per-rank reports."""
        return self._memory("offload")

    def onload(self) -> list[dict[str, Any]]:
        """Every rank wakes; per-rank reports. A rank that never slept is awake."""
        return self._memory("onload")

    def _memory(self, method: str) -> list[dict[str, Any]]:
        # No ranks, or a dead one, is not an error here: the next step that needs
        # the trainer recreates it through ensure_state, and new ranks start awake.
        try:
            actors = self.actors()
            refs = [getattr(a, method).remote() for a in actors]
            return ray.get(refs, timeout=PG_READY_TIMEOUT_S)
        except (ValueError, ray.exceptions.RayActorError) as e:
            log.info("train group %s: %s skipped (%s)", self.run_name, method, type(e).__name__)
            return []
