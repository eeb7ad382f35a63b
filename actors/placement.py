"""Where a run's actors sit: the node pinning of each side, and the shared
placement group of a colocated run (``placement.colocate: true``).

**Node pinning.** ``engines.node_resource`` and ``train.node_resource`` name a
custom Ray resource that only that side's hosts offer (``ray start
--resources='{"engine_host": 1}'``). Every bundle of the side asks for
``NODE_SHARE`` of it, so the side runs on those nodes only, however many of its
bundles a node holds. ``unplaceable`` says why a bundle waits: no alive node
offers the resource, naming the nodes that offered it and died.

**Colocation.**

Owns one detached placement group ``{run}/colocate-pg`` with one bundle per
device: ``max(train ranks, engines * tp_size)`` bundles, each with one GPU (on
GPUs) and the CPUs of the actors that use it. Train rank i sits on bundle i;
rank j of engine e sits on bundle ``e * tp_size + j``, so every device holds
one train rank and one engine rank, which take turns on it (``tasks.colocate``).

Neither group removes it when it kills its actors (``TrainGroup.release``, an
engine restart): the other side still lives in it. ``EngineGroup.shutdown``
(end of run, after the trainer) removes it. Holds names and numbers only, so
it pickles into any task; the group is found again by name, cluster-wide.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from actors.resources import RAY_RESOURCES

# Of a side's node resource per bundle: enough to pin it, small enough that a node
# offering 1 unit holds up to 1,000 bundles (Ray keeps 4 decimals of a resource).
NODE_SHARE = 0.001
MAX_NAMED = 5  # lost nodes named in a message (a long-lived cluster collects many)


def pinned(bundle: dict[str, float], resource: str | None) -> dict[str, float]:
    """``bundle`` plus ``NODE_SHARE`` of ``resource`` (a copy; unchanged when None)."""
    return dict(bundle) if resource is None else {**bundle, resource: NODE_SHARE}


def describe_node(node: dict) -> str:
    """``id-prefix (ip, offers resource...)`` of a ``ray.nodes()`` entry: how an
    operator tells nodes apart (on one host they share an IP)."""
    own = sorted(
        r for r in node.get("Resources", {}) if r not in RAY_RESOURCES and not r.startswith("node:")
    )
    offers = f", offers {', '.join(own)}" if own else ""
    return f"{node['NodeID'][:12]} ({node.get('NodeManagerAddress', '?')}{offers})"


def unplaceable(resource: str | None) -> str:
    """Why a bundle pinned to ``resource`` (None: any node) finds no room: the lost
    (dead) nodes of the cluster, and how many alive nodes offer the resource."""
    nodes = ray.nodes()
    # Ray forgets a dead node's resources, so every lost node is named: one of them
    # was the host (its id is in the step records, e.g. a reload's pull.node).
    lost = [n for n in nodes if not n.get("Alive")]
    alive = [n for n in nodes if n.get("Alive") and (resource or "CPU") in n.get("Resources", {})]
    parts = []
    if lost:
        named = ", ".join(describe_node(n) for n in lost[-MAX_NAMED:])
        more = f" and {len(lost) - MAX_NAMED} earlier" if len(lost) > MAX_NAMED else ""
        parts.append(f"lost node(s) {named}{more} died")
    what = f"resource {resource!r}" if resource else "CPUs"
    if alive:
        parts.append(f"the {len(alive)} alive node(s) offering {what} are too busy or too small")
    else:
        parts.append(f"no alive node offers {what}")
    fix = (
        f"start a replacement with `ray start --address=<head> --resources='{{\"{resource}\": 1}}'`"
        if resource
        else "add nodes or free resources"
    )
    return "; ".join(parts) + f"; {fix}, then rerun"


def colocated_bundles(
    train_ranks: int,
    train_cpus: float,
    engine_ranks: int,
    engine_cpus: float,
    gpus: bool,
    resource: str | None = None,
) -> list[dict[str, float]]:
    """One bundle per device, holding the CPUs of the ranks placed on it.

    A bundle reserves a whole GPU that its two actors split by their
    fractional ``num_gpus``; without GPUs a bundle is CPUs only.
    """
    bundles = []
    for b in range(max(train_ranks, engine_ranks)):
        cpus = (train_cpus if b < train_ranks else 0.0) + (engine_cpus if b < engine_ranks else 0.0)
        bundles.append(pinned({"CPU": cpus, "GPU": 1.0} if gpus else {"CPU": cpus}, resource))
    return bundles


@dataclass(frozen=True)
class SharedPlacement:
    """Names and shape of a colocated run's placement group; see the module docstring."""

    run_name: str  # the run the group belongs to
    bundles: tuple[dict[str, float], ...]  # one per device, from colocated_bundles
    tp_size: int  # ranks per engine: engine e owns bundles e*tp_size .. e*tp_size+tp_size-1
    resource: str | None = None  # the node resource both sides are pinned to (one value)

    @property
    def name(self) -> str:
        return f"{self.run_name}/colocate-pg"

    def train_bundle(self, rank: int) -> int:
        return rank

    def engine_bundles(self, engine_id: int) -> list[int]:
        """Bundles of engine ``engine_id``'s ranks; the engine actor is rank 0 on the first."""
        first = engine_id * self.tp_size
        return list(range(first, first + self.tp_size))

    def find(self) -> PlacementGroup | None:
        """The live group, or None; refuses one of another shape (a run with other sizes left it)."""
        found = self._lookup()
        if found is None:
            return None
        pg, n = found
        if n != len(self.bundles):
            raise RuntimeError(
                f"placement group {self.name!r} has {n} bundles but this config needs "
                f"{len(self.bundles)}: a run with other train.num_workers / engines.num_engines "
                "/ engines.tp_size left it; shut that run's engines down (or restart the Ray "
                "cluster) first"
            )
        return pg

    def ensure(self, timeout_s: float) -> PlacementGroup:
        """The group, created if missing; waits until its bundles are reserved."""
        pg = self.find() or placement_group(
            [dict(b) for b in self.bundles],
            strategy="PACK",  # one host when it fits; colocation itself is per bundle
            name=self.name,
            lifetime="detached",  # outlives the task that created it, like the actors
        )
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"the colocated placement group {self.name!r} ({len(self.bundles)} x "
                f"{self.bundles[0]}) could not be placed within {timeout_s:.0f}s: "
                f"{unplaceable(self.resource)}; or stop other runs' actors, or lower "
                "train.num_workers / engines.num_engines"
            ) from None
        return pg

    def remove(self) -> None:
        """Remove the group; any actor still in it dies with it."""
        found = self._lookup()
        if found is not None:
            remove_placement_group(found[0])

    def _lookup(self) -> tuple[PlacementGroup, int] | None:
        # The table is cluster-wide: a later flow run (another Ray job) finds the
        # group an earlier one created, as EngineGroup does for its own groups.
        for pg_id, info in placement_group_table().items():
            if info.get("name") == self.name and info.get("state") != "REMOVED":
                pg = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id)))
                return pg, len(info.get("bundles", {}))
        return None
