"""The engine group: naming, placement, restart and dispatch of rollout engines.

Owns the driver-side view of a run's engines. It holds only names and config
(picklable); the engines are detached, named Ray actors found again by name:

- engine ``i`` is the actor ``{run_name}/engine/{i}`` in ``namespace``, placed
  on bundle 0 of its own placement group ``{run_name}/engine-pg/{i}`` (one
  bundle per rank) or, colocated, on its bundles of the run's shared group
  (``actors.placement``), which a restart leaves in place;
- a dead engine is replaced by ``restart``: kill, recreate in the same
  placement group (so on the node its weights were pulled to, ``pull``),
  and load the version it is told to serve; ``engines.node_resource`` pins the
  groups to the engine hosts (``actors.placement``).

Rollout dispatch (``generate_groups``, ``generate_rows``) is ``engines.dispatch``,
which the group hands itself and its restart.

It never decides which version should be served: the caller (reload, verify)
does; a restart defaults to the version a live peer reports.

Every wait on an engine ends by ``call_timeout_s`` (the step's deadline): a
stuck engine fails the call with a ``CallTimeout`` naming it (``actors.deadline``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors import deadline
from actors.history import ran_before
from actors.placement import SharedPlacement, pinned, unplaceable
from engines import dispatch
from engines.client import EngineClient
from engines.config import EngineConfig
from engines.dispatch import RestartFn
from engines.node_pull import pull_on_node
from engines.types import AdapterServing, GenerateResult
from storage.config import StorageConfig

log = logging.getLogger(__name__)


class EngineGroup:
    """Driver-side handle on a run's engines; holds names and config only."""

    def __init__(
        self,
        run_name: str,
        cfg: EngineConfig,
        namespace: str = "prefect-rl",
        placement: SharedPlacement | None = None,
        call_timeout_s: float | None = None,
        weights_run: str | None = None,
        adapters: AdapterServing | None = None,
    ) -> None:
        """``adapters``: the run's versions are LoRA adapters; SGLang servers are
        launched to serve them."""
        self.run_name = run_name
        self.adapters = adapters
        # The run whose versions ``pull`` reads (default run_name): an evaluation's
        # group has names of its own and loads another run's versions.
        self.weights_run = weights_run or run_name
        self.cfg = cfg
        self.namespace = namespace
        self.placement = placement  # colocated: the shared group the engines sit in
        self.call_timeout_s = call_timeout_s  # deadline of each wait on engines; None: none
        # What start() was given: the fallback for restarts when no peer is alive.
        self.model_path: str | None = None
        self.weight_version: int = 0

    def actor_name(self, i: int) -> str:
        return f"{self.run_name}/engine/{i}"

    def pg_name(self, i: int) -> str:
        return f"{self.run_name}/engine-pg/{i}"

    # ---- lifecycle --------------------------------------------------------

    def start(self, model_path: str, weight_version: int = 0) -> None:
        """Create every missing engine with ``model_path`` as ``weight_version``.

        Idempotent: engines that already exist are left as they are (a reload
        task, not start, changes what they serve). Returns once all are ready.
        """
        self.model_path, self.weight_version = model_path, int(weight_version)
        handles = []
        for i in range(self.cfg.num_engines):
            h = self.handle(i)
            handles.append(h if h is not None else self._create(i, model_path, weight_version))
        names = [self.actor_name(i) for i in range(self.cfg.num_engines)]
        refs = [h.get_weight_version.remote() for h in handles]
        deadline.get(refs, self.call_timeout_s, "start (load the model)", names)

    def handle(self, i: int) -> ActorHandle | None:
        """The engine's actor handle, or None if it does not exist (or died)."""
        try:
            return ray.get_actor(self.actor_name(i), namespace=self.namespace)
        except ValueError:
            return None

    def handles(self) -> dict[int, ActorHandle]:
        """Handles of the engines that exist now, by index."""
        found = {i: self.handle(i) for i in range(self.cfg.num_engines)}
        return {i: h for i, h in found.items() if h is not None}

    def is_alive(self, i: int) -> bool:
        """True if the engine answers a 1-token generation within health_timeout_s
        (an engine whose decode loop died answers False: it needs a restart)."""
        h = self.handle(i)
        if h is None:
            return False
        try:
            return bool(ray.get(h.health_generate.remote(), timeout=self.cfg.health_timeout_s))
        except (RayActorError, GetTimeoutError):
            return False

    def ran_before(self, i: int) -> bool:
        """Whether engine i exists (hung) or ran and died in this cluster: starting it
        now is a restart, not its first start (``actors.history``)."""
        return ran_before([self.actor_name(i)])

    def restart(self, i: int, model_path: str, weight_version: int) -> ActorHandle:
        """Replace engine ``i`` with a fresh one serving ``weight_version``.

        Its placement group stays, so the new engine lands on the node where
        ``model_path`` was pulled (``pull``); after a lost node, Ray has
        moved the group's bundles to a node that can hold them, or it waits."""
        if self.ran_before(i):  # a first start is no fault: INFO, not a warning
            log.warning("restarting %s at version %s", self.actor_name(i), weight_version)
        else:
            log.info("starting %s at version %s", self.actor_name(i), weight_version)
        self._kill(i, keep_placement=True)
        h = self._create(i, model_path, weight_version)
        deadline.get(
            h.get_weight_version.remote(), self.call_timeout_s, "restart", self.actor_name(i)
        )
        return h

    def shutdown(self) -> None:
        """Kill every engine and remove its placement group.

        Colocated, that is the run's shared group: shut the trainer down first,
        as the end of a run does (any rank still in it dies with it).
        """
        for i in range(self.cfg.num_engines):
            self._kill(i)
        if self.placement is not None:
            self.placement.remove()

    def _kill(self, i: int, keep_placement: bool = False) -> None:
        h = self.handle(i)
        if h is not None:
            if (
                self.cfg.kind == "sglang"
            ):  # a graceful stop first; the server also dies with the actor
                try:
                    ray.get(h.stop.remote(), timeout=self.cfg.sglang.stop_timeout_s + 10)
                except Exception:  # a dead or hung actor: the kill below still ends it
                    log.warning("%s: graceful stop failed", self.actor_name(i))
            ray.kill(h, no_restart=True)
        pg = None if keep_placement else self._find_pg(i)
        if pg is not None:
            ray.util.remove_placement_group(pg)

    def _find_pg(
        self, i: int, bundles: list[dict[str, float]] | None = None
    ) -> PlacementGroup | None:
        """Engine i's live group; with ``bundles``, one of another shape (left by a run
        with other sizes or pinning) is removed and None returned."""
        # The placement group table is cluster-wide, unlike get_placement_group,
        # which only sees the calling job's namespace: a later flow run (another
        # job) must still find and remove the group a former run created.
        for pg_id, info in placement_group_table().items():
            if info.get("name") == self.pg_name(i) and info.get("state") != "REMOVED":
                pg = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id)))
                if bundles is not None and list(info.get("bundles", {}).values()) != bundles:
                    ray.util.remove_placement_group(pg)
                    return None
                return pg
        return None

    def pull(self, i: int, storage: StorageConfig, version: int, cache_dir: str) -> dict[str, Any]:
        """Version ``version`` in the local cache of the node engine i sits (or will
        sit) on, pulled there in its bundle (``engines.node_pull``); what it took."""
        pg, (bundle, *_) = self._place(i)
        strategy = PlacementGroupSchedulingStrategy(pg, bundle)
        return pull_on_node(
            strategy,
            storage,
            self.weights_run,
            version,
            cache_dir,
            self.call_timeout_s,
            self.actor_name(i),
        )

    def _create(self, i: int, model_path: str, weight_version: int) -> ActorHandle:
        pg, (bundle, *rank_bundles) = self._place(i)
        gpus = self.cfg.num_gpus_per_engine
        options: dict[str, Any] = dict(
            name=self.actor_name(i),
            namespace=self.namespace,
            lifetime="detached",
            num_cpus=self.cfg.num_cpus_per_engine,
            # The SGLang server's TP processes share the actor's reservation.
            num_gpus=gpus * self.cfg.tp_size if self.cfg.kind == "sglang" else gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, bundle),
        )
        kwargs: dict[str, Any] = {}
        if rank_bundles:
            kwargs["rank_bundles"] = rank_bundles
        if self.adapters is not None and self.cfg.kind == "sglang":
            kwargs["adapters"] = self.adapters
        if self.cfg.kind == "sglang":
            from engines.sglang.engine import actor_class as sglang_actor_class

            cls = sglang_actor_class()
        else:
            # Imported here, like SGLang's: the module brings torch and transformers,
            # which a process that only imports the group (a flow) must not load.
            from engines.embedded.engine import actor_class

            cls = actor_class()
        # ray.kill is asynchronous: the old actor's name can stay taken for a
        # moment after a kill, so retry the named creation briefly.
        deadline = time.monotonic() + self.cfg.health_timeout_s
        while True:
            try:
                return cls.options(**options).remote(
                    model_path, i, self.cfg, weight_version, **kwargs
                )
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def _place(self, i: int) -> tuple[PlacementGroup, list[int]]:
        """Engine i's placement group and its bundles: the actor's, then its other ranks'."""
        if self.placement is not None:
            pg = self.placement.ensure(self.cfg.health_timeout_s)
            return pg, self.placement.engine_bundles(i)
        cpus, gpus, tp = (
            self.cfg.num_cpus_per_engine,
            self.cfg.num_gpus_per_engine,
            self.cfg.tp_size,
        )
        if self.cfg.kind == "sglang":
            # The server spawns its own TP processes: one bundle holds all its GPUs.
            bundles = [{"CPU": cpus, "GPU": gpus * tp}]
        else:
            # One bundle per rank; the actor is rank 0 and places the others itself.
            bundles = [{"CPU": cpus, "GPU": gpus} for _ in range(tp)]
        if not gpus:
            for b in bundles:
                del b["GPU"]
        bundles = [pinned(b, self.cfg.node_resource) for b in bundles]  # its hosts only
        pg = self._find_pg(i, bundles) or placement_group(
            bundles, strategy="STRICT_PACK", name=self.pg_name(i), lifetime="detached"
        )
        try:
            ray.get(pg.ready(), timeout=self.cfg.health_timeout_s)
        except GetTimeoutError:
            raise RuntimeError(
                f"{self.pg_name(i)} ({bundles}) could not be placed within "
                f"{self.cfg.health_timeout_s:.0f}s (engines.health_timeout_s): "
                f"{unplaceable(self.cfg.node_resource)}"
            ) from None
        return pg, list(range(len(bundles)))

    def _default_restart(self, i: int) -> None:
        """Restart ``i`` with the version a live peer serves (one serving full weights:
        an adapter is loaded by the run's own restart), else start()'s."""
        path, version = self.model_path, self.weight_version
        for j, h in self.handles().items():
            if j == i:
                continue
            try:
                info = ray.get(h.model_info.remote(), timeout=self.cfg.health_timeout_s)
            except (RayActorError, GetTimeoutError):
                continue
            if info.get("lora_name"):  # base + adapter: its model_path alone is not that
                continue
            path, version = info["model_path"], int(info["weight_version"])
            break
        if path is None:
            raise ValueError("no model to restart with: call start() or pass restart_fn")
        self.restart(i, path, version)

    # ---- rollout dispatch ---------------------------------------------------

    def generate_groups(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: dict[str, Any],
        seeds: list[list[int]],
        restart_fn: RestartFn | None = None,
        max_restarts: int = 2,
        lora_path: str | None = None,
    ) -> list[list[GenerateResult]]:
        """``n`` samples per prompt, in prompt order; ``seeds[g][j]``: sample j of
        prompt g's sampling_seed. Dispatch and restarts: ``generate_rows``."""
        rows, params = dispatch.group_rows(prompts, n, sampling, seeds)
        return self.generate_rows(rows, params, restart_fn, max_restarts, lora_path)

    def generate_rows(
        self,
        rows: list[list[list[int]]],
        params: list[list[dict[str, Any]]],
        restart_fn: RestartFn | None = None,
        max_restarts: int = 2,
        lora_path: str | None = None,
    ) -> list[list[GenerateResult]]:
        """Group g's rows ``rows[g]`` with its ``params[g]`` entry, group g on engine
        ``g % engines`` in one call (``dispatch.generate_rows``). A dead engine is
        restarted by ``restart_fn(i)`` (default: at the version a live peer serves)
        at most ``max_restarts`` times and its share sent again whole. ``lora_path``:
        the adapter version every row samples from (``wire.lora.adapter_name``)."""
        restart = restart_fn or self._default_restart
        return dispatch.generate_rows(
            self, rows, params, restart, max_restarts, self.call_timeout_s, lora_path
        )

    # ---- HTTP -------------------------------------------------------------

    def start_http(
        self, host: str = "127.0.0.1", port: int = 0, allowed_roots: list[str] | None = None
    ) -> dict[int, str]:
        """Each engine's SGLang HTTP URL, starting embedded engines' servers where needed.

        Embedded engine i listens on ``port + i`` (``port`` 0: a free port) and
        reloads only from ``allowed_roots`` (plus its config's); an SGLang engine
        serves HTTP already.
        """
        urls = {}
        for i, h in self.handles().items():
            if self.cfg.kind == "sglang":
                ref, call = h.http_url.remote(), "http_url"
            else:
                p = port + i if port else 0
                ref, call = h.start_http.remote(host, p, allowed_roots), "start_http"
            urls[i] = deadline.get(ref, self.call_timeout_s, call, self.actor_name(i))
        return urls

    def urls(self) -> dict[int, str]:
        """URLs of the engines that serve HTTP now, by index."""
        handles = self.handles()
        names = [self.actor_name(i) for i in handles]
        refs = [h.http_url.remote() for h in handles.values()]
        found = dict(zip(handles, deadline.get(refs, self.call_timeout_s, "http_url", names)))
        return {i: u for i, u in found.items() if u}

    def client(self, i: int, **kwargs: Any) -> EngineClient:
        """An HTTP client of engine i, with the admin token from ``engines.api_key_env``
        and the group's deadline on every request."""
        url = self.urls().get(i)
        if url is None:
            raise RuntimeError(f"{self.actor_name(i)} serves no HTTP: call start_http() first")
        kwargs.setdefault("deadline_s", self.call_timeout_s)
        return EngineClient(url, api_key=os.environ.get(self.cfg.api_key_env) or None, **kwargs)
