"""Pull a weight version into the local cache of the node an engine runs on.

On one machine the driver could pull for every engine; across nodes each
engine host needs the files on its own disk. So the pull runs as a Ray task in
the engine's placement bundle, on its node, into ``engines.local_cache_dir``
as that node sees it (``~`` expanded there). Engines of one node share the
copy: ``storage.pull`` locks the cache folder, so a version crosses the network
once per node however many engines reload it at once. Never imports Prefect.
"""

from __future__ import annotations

from typing import Any

import ray

from actors import deadline
from storage.config import StorageConfig
from storage.run_store import RunStore


@ray.remote(num_cpus=0)  # it waits on the network and disk; the bundle's CPUs are the engine's
def _pull_here(storage: StorageConfig, run_name: str, version: int, cache_dir: str) -> dict:
    pulled = RunStore(storage, run_name).pull(version, cache_dir)
    return {**pulled.model_dump(), "node": ray.get_runtime_context().get_node_id()}


def pull_on_node(
    strategy: Any,
    storage: StorageConfig,
    run_name: str,
    version: int,
    cache_dir: str,
    timeout_s: float | None,
    who: str,
) -> dict[str, Any]:
    """``storage.Pulled`` of version ``version`` on the node ``strategy`` places a
    task on (an engine's bundle: ``EngineGroup.pull``), plus that ``node``'s Ray id."""
    ref = _pull_here.options(scheduling_strategy=strategy).remote(
        storage, run_name, version, cache_dir
    )
    return deadline.get(ref, timeout_s, f"pull v{version} to its node's cache", who)
