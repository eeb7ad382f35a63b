"""The shared placement group of a colocated run (``placement.colocate: true``).

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


def colocated_bundles(
    train_ranks: int,
    train_cpus: float,
    engine_ranks: int,
    engine_cpus: float,
    gpus: bool,
) -> list[dict[str, float]]:
    """One bundle per device, holding the CPUs of the ranks placed on it.

    A bundle reserves a whole GPU that its two actors split by their
    fractional ``num_gpus``; without GPUs a bundle is CPUs only.
    """
    bundles = []
    for b in range(max(train_ranks, engine_ranks)):
        cpus = (train_cpus if b < train_ranks else 0.0) + (engine_cpus if b < engine_ranks else 0.0)
        bundles.append({"CPU": cpus, "GPU": 1.0} if gpus else {"CPU": cpus})
    return bundles


@dataclass(frozen=True)
class SharedPlacement:
    """Names and shape of a colocated run's placement group; see the module docstring."""

    run_name: str  # the run the group belongs to
    bundles: tuple[dict[str, float], ...]  # one per device, from colocated_bundles
    tp_size: int  # ranks per engine: engine e owns bundles e*tp_size .. e*tp_size+tp_size-1

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
                f"{self.bundles[0]}) could not be placed within {timeout_s:.0f}s: the Ray "
                "cluster lacks free resources; stop other runs' actors or lower "
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
