"""Custom Ray resources that pin a side of the run to the hosts that offer them
(``engines.node_resource``, ``train.node_resource``): the names Ray keeps for
itself, and the check each config section runs on what the user gave.
"""

from __future__ import annotations

# Ray's own resource names: pinning to one of them would pin nothing.
RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
# Ray reserves names starting with this (node:__internal_head__ marks the head):
# a cluster refuses them as custom resources, in its own words, after the run began.
RAY_RESERVED_PREFIX = "node:__"


def check_node_resource(key: str, value: str | None) -> str | None:
    """A custom Ray resource name for ``key`` (``engines.node_resource``, ...), or None."""
    if value is not None and (
        not value.strip() or value in RAY_RESOURCES or value.startswith(RAY_RESERVED_PREFIX)
    ):
        raise ValueError(
            f"{key} {value!r} is not a custom resource (Ray's own: {', '.join(RAY_RESOURCES)} "
            f"and names starting with {RAY_RESERVED_PREFIX}): give the name your nodes offer "
            "with ray start --resources='{\"engine_host\": 1}' (e.g. engine_host), or leave it "
            "unset"
        )
    return value
