"""The one way every flow connects to Ray: the configured ``ray.address``, or a
new local cluster of this process. Never Ray's ``"auto"``: that joins whatever
cluster Ray's current-cluster file names, and a cluster killed without
``ray stop`` leaves that file behind, so a flow would wait minutes on a dead
address ("Failed to connect to GCS").

A configured address is checked before ``ray.init``: nothing answering there
fails within seconds with the address in the message, and a cluster with fewer
CPUs than the run's actors reserve fails at once instead of leaving a placement
group pending forever.

Across nodes, two more checks once joined: every node resource a side is
pinned to (``engines.node_resource``, ``train.node_resource``) is offered by an
alive node, and a local ``storage.root`` is one filesystem on every node that
may host a side: a probe file written here must be visible from each of them
(``check_shared_root``), else the run is refused before it starts, naming the
node. A local cluster of this process offers the configured node resources
itself, so a pinned config also runs on one machine. No Prefect here.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.placement import describe_node, unplaceable
from tasks.config import ConfigError, RunConfig

log = logging.getLogger("prefect_rl.cluster")

CONNECT_TIMEOUT_S = 5.0  # a live GCS answers a TCP connect at once
# The local cluster's logical CPUs beyond the actors' bundles: the Ray tasks
# beside them (reward scoring, per-node weight pulls) need room on a 2-core machine.
LOCAL_SPARE_CPUS = 4
# A probe is a file lookup, but a node may first have to start a Python worker for it.
PROBE_TIMEOUT_S = 60.0
# Task attempts whose events (state changes, profile) a local cluster's GCS keeps, the
# oldest dropped first. Under Ray's default, 100,000, the GCS grew 48 MB per 1,000
# iterations of tiny-cpu and was still growing at 700 (80 MB; bench/soak.py). The
# newest 2,000 calls (at most the last ~150 iterations of tiny-cpu) stay visible to
# `ray list tasks`. RAY_task_events_max_num_task_in_gcs exported by the user wins;
# a cluster at ray.address is configured by its own `ray start`.
LOCAL_TASK_EVENTS_CAP = 2_000


def actor_cpus(cfg: RunConfig) -> float:
    """The Ray CPUs the run's engines and train ranks reserve together."""
    e, t = cfg.engines, cfg.train
    return e.num_engines * e.tp_size * e.num_cpus_per_engine + t.num_workers * t.num_cpus_per_worker


def gcs_endpoint(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``ray.address``; ConfigError for an address that is not one."""
    if address in ("auto", "local"):
        raise ConfigError(
            f"ray.address {address!r} is not an address: 'auto' joins whatever cluster a "
            "(possibly stale) file names. Give the head's host:port, e.g. "
            "ray.address=127.0.0.1:6379, or leave ray.address unset for a local cluster"
        )
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(
            f"ray.address {address!r} is not host:port (e.g. 127.0.0.1:6379, the address "
            "`ray start --head` prints)"
        )
    return host.strip("[]"), int(port)


def check_address(address: str) -> None:
    """Raise ConfigError within seconds when nothing listens at ``address``."""
    host, port = gcs_endpoint(address)
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        raise ConfigError(
            f"no Ray cluster answers at ray.address {address} ({e}); start one there "
            f"(ray start --head --port={port} --num-cpus=8) or leave ray.address unset to "
            "start a local cluster for this run"
        ) from None


def connect_ray(cfg: RunConfig) -> None:
    """Join ``cfg.ray.address`` or start this process's own local cluster (see module doc)."""
    if ray.is_initialized():
        return
    if cfg.ray.address is None:
        start_local_ray(
            cfg.ray.num_cpus or int(actor_cpus(cfg)) + LOCAL_SPARE_CPUS,
            cfg.ray.namespace,
            {r: 1.0 for r in node_resources(cfg)},
        )
        return
    address = cfg.ray.address
    check_address(address)
    try:
        ray.init(
            address=address,
            namespace=cfg.ray.namespace,
            include_dashboard=False,
            log_to_driver=False,
        )
    except Exception as e:  # auth, version mismatch: say which cluster and what to check
        raise ConnectionError(
            f"could not join the Ray cluster at ray.address {address}: {type(e).__name__}: {e}; "
            f"this process runs with RAY_AUTH_MODE={os.environ.get('RAY_AUTH_MODE', '(unset)')}. "
            "A cluster with token auth needs RAY_AUTH_MODE=token exported here too (an explicit "
            "address never turns it on by itself) and the cluster's token as ~/.ray/auth_token, "
            "RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN (docs/security.md, Ray)"
        ) from None
    check_cpus(cfg, address)
    check_shared_root(cfg)


def node_resources(cfg: RunConfig) -> set[str]:
    """The custom resources the run's sides are pinned to (none when unpinned)."""
    return {r for r in (cfg.engines.node_resource, cfg.train.node_resource) if r}


def actor_gpus(cfg: RunConfig) -> float:
    """The GPUs the run's actors reserve when each side has its own (colocated, they share)."""
    e, t = cfg.engines, cfg.train
    if cfg.placement.colocate:
        return 0.0
    return e.num_engines * e.tp_size * e.num_gpus_per_engine + t.num_workers * t.num_gpus_per_worker


def shortfall(cfg: RunConfig, address: str, total: dict[str, float]) -> str | None:
    """Why a cluster of ``total`` resources cannot hold the run's actors (None: it can)."""
    need, have = actor_cpus(cfg), total.get("CPU", 0.0)
    if have < need:
        return (
            f"the Ray cluster at {address} has {have:g} CPUs but the run's engines and train "
            f"ranks reserve {need:g}; start its head with more logical CPUs "
            f"(ray start --head --num-cpus={int(need) + LOCAL_SPARE_CPUS}), or lower "
            "engines.num_cpus_per_engine / train.num_cpus_per_worker"
        )
    for side, r in (("engines", cfg.engines.node_resource), ("train", cfg.train.node_resource)):
        if r and total.get(r, 0.0) <= 0:
            return (
                f"{side}.node_resource pins that side to resource {r!r}, which no node of the "
                f"Ray cluster at {address} offers: {unplaceable(r)}; or unset "
                f"{side}.node_resource"
            )
    need, have = actor_gpus(cfg), total.get("GPU", 0.0)
    if have < need:
        return (
            f"the Ray cluster at {address} has {have:g} GPUs but the run's engines and train "
            f"ranks reserve {need:g}; start its nodes on GPU machines, or lower "
            "engines.num_gpus_per_engine / train.num_gpus_per_worker"
        )
    return None


def check_cpus(cfg: RunConfig, address: str) -> None:
    """Refuse a cluster too small for the run's actors: their placement groups
    would stay pending (``Pending Demands``) and the run would wait silently."""
    why = shortfall(cfg, address, ray.cluster_resources())
    if why is not None:
        ray.shutdown()
        raise ConfigError(why)


def start_local_ray(
    num_cpus: int, namespace: str, resources: dict[str, float] | None = None
) -> None:
    """Start this process's own Ray cluster, listening on loopback only.

    Its auth is off (RAY_AUTH_MODE=disabled unless the user exported a mode),
    so nothing but this machine may reach it. Ray 2.60 turns
    ``_node_ip_address="127.0.0.1"`` into the host's routable IP and then binds
    GCS, raylet and workers on all interfaces, unless ``ENABLE_RAY_CLUSTER`` is
    off (its macOS/Windows mode): with it off the node IP stays 127.0.0.1 and
    every server binds loopback. Once the node exists Ray reads the IP from it,
    so the switch is restored. ``tests/integration/test_security.py`` checks the
    real sockets. The cluster's processes end with this one (``tasks.reaper``).
    """
    from ray._private import ray_constants

    from tasks import reaper

    # Unset, Ray 2.60 turns token auth on for a new local cluster and writes a
    # token to ~/.ray; a loopback-only cluster of one process needs neither.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    reaper.guard()  # before Ray spawns anything: its processes carry this process's mark
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        # address="local": never join a cluster someone else started on this machine.
        ray.init(
            address="local",
            num_cpus=num_cpus,
            resources=resources or None,  # the node resources a pinned config asks for
            namespace=namespace,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
            _system_config=local_system_config(),
        )
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
    stop_log_monitor()


def local_system_config() -> dict[str, int]:
    """Ray settings of a local cluster: its GCS keeps a bounded task-event history
    (``LOCAL_TASK_EVENTS_CAP``) unless the user exported Ray's own variable."""
    if "RAY_task_events_max_num_task_in_gcs" in os.environ:
        return {}
    return {"task_events_max_num_task_in_gcs": LOCAL_TASK_EVENTS_CAP}


def stop_log_monitor() -> None:
    """End the log monitor of the cluster this process started.

    It tails every worker's log files to forward them to drivers, and our drivers
    join with ``log_to_driver=False``: nothing reads what it sends, yet it polls
    for the whole run (about 10 CPU s in 20 minutes on 2 cores, more with many
    actors). ``ray.init`` cannot leave it out (only ``ray start
    --include-log-monitor=false`` can), so it is ended once the node is up. Worker
    logs stay in the session's log folder.
    """
    node = ray._private.worker._global_node
    if node is not None and node.head:
        node.kill_log_monitor(check_alive=False)


@ray.remote(num_cpus=0)
def _sees(path: str) -> bool:
    return os.path.exists(path)


def host_nodes(cfg: RunConfig) -> list[dict]:
    """Alive nodes that may host an engine or a train rank (every alive node offering
    CPUs, when a side is unpinned)."""
    pins = [cfg.engines.node_resource, cfg.train.node_resource]
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if None in pins:
        return [n for n in alive if n.get("Resources", {}).get("CPU", 0) > 0]
    return [n for n in alive if any(r in n.get("Resources", {}) for r in pins)]


def check_shared_root(cfg: RunConfig) -> None:
    """Refuse a local ``storage.root`` that some node hosting a side does not see.

    The trainer writes checkpoints and versions there and the disk transport's
    engines load from it, so it must be one filesystem everywhere. A probe file is
    written here and looked for from each such node (one tiny task per node), which
    catches a path that exists on every node but on each one's own disk. Skipped
    for object stores, and for a single node on this host (nothing to compare)."""
    from storage.fs import is_local, open_root

    fs, root = open_root(cfg.storage.root, cfg.storage.s3)
    if not is_local(fs):
        return
    nodes = host_nodes(cfg)
    here = ray.util.get_node_ip_address()
    if len(nodes) <= 1 and all(n.get("NodeManagerAddress") == here for n in nodes):
        return
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, f".probe-{uuid.uuid4().hex}")
    with open(path, "w") as f:
        f.write(here)
    try:
        refs = [
            _sees.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote(path)
            for n in nodes
        ]
        _, late = ray.wait(refs, num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
        seen = [r not in late and ray.get(r) for r in refs]
    finally:
        os.unlink(path)
    blind = [n for n, ok in zip(nodes, seen) if not ok]
    if blind:
        names = ", ".join(describe_node(n) for n in blind)
        ray.shutdown()  # as check_cpus: a refused run leaves no Ray connection behind
        raise ConfigError(
            f"storage.root {cfg.storage.root!r} is a local path, but Ray node(s) {names}, "
            f"which may host engines or train ranks, do not see it (a probe file written "
            f"here is missing there, or the probe got no answer in {PROBE_TIMEOUT_S:g}s): with weights.transport {cfg.weights.transport!r} every "
            "node reads and writes the run's versions and checkpoints there. Mount one "
            "shared filesystem at that path on every node (NFS, Lustre, a shared volume), "
            "or use an object store: storage.root: s3://bucket/prefix with weights.transport: "
            "object-store and engines.local_cache_dir on each node's own disk"
        )
