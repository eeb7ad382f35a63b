"""Node pinning (``engines.node_resource``, ``train.node_resource``): what the
bundles ask for, and the configs that cannot work refused with the fix named.
The runs themselves are in tests/e2e/test_multinode.py."""

from __future__ import annotations

import pytest

from actors.placement import NODE_SHARE, colocated_bundles, describe_node, pinned
from flows.config import ConfigError, load_config

PINS = {"engines.node_resource": "engine_host", "train.node_resource": "train_host"}


def test_a_pinned_bundle_asks_for_a_share_of_the_resource():
    assert pinned({"CPU": 0.5}, "engine_host") == {"CPU": 0.5, "engine_host": NODE_SHARE}
    assert pinned({"CPU": 0.5}, None) == {"CPU": 0.5}
    shared = colocated_bundles(1, 0.5, 1, 0.5, gpus=True, resource="gpu_host")
    assert shared == [{"CPU": 1.0, "GPU": 1.0, "gpu_host": NODE_SHARE}]


def test_sides_pinned_apart_load_with_transports_that_cross_hosts():
    for transport in ("disk", "distributed"):
        cfg = load_config(None, {**PINS, "weights.transport": transport})
        assert (cfg.engines.node_resource, cfg.train.node_resource) == ("engine_host", "train_host")


@pytest.mark.parametrize(
    "extra, says",
    [
        ({"weights.transport": "tensor"}, "use weights.transport: distributed"),
        ({"placement.colocate": True}, "give both the same resource"),
    ],
)
def test_sides_pinned_apart_refuse_what_needs_one_host(extra, says):
    with pytest.raises(ConfigError, match=says):
        load_config(None, {**PINS, **extra})


@pytest.mark.parametrize("name", ["CPU", "GPU", " "])
def test_a_ray_resource_is_not_a_pin(name):
    with pytest.raises(ConfigError, match="is not a custom resource"):
        load_config(None, {"engines.node_resource": name})


def test_a_node_is_described_by_its_own_resources():
    node = {
        "NodeID": "ab" * 28,
        "NodeManagerAddress": "10.0.0.7",
        "Resources": {"CPU": 8.0, "memory": 1.0, "node:10.0.0.7": 1.0, "train_host": 1.0},
    }
    assert describe_node(node) == "abababababab (10.0.0.7, offers train_host)"
