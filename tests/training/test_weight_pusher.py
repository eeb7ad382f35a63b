"""``WeightPusher`` without engines: what a rank does that sends nothing, and
the transports it refuses. Pushes to real engines are
``tests/integration/test_weight_transports.py`` and ``test_tensor_handoff.py``."""

from __future__ import annotations

import pytest
import torch

from training.weight_pusher import WeightPusher


def named(seen: list[str]):
    for name in ("a", "b", "c"):
        seen.append(name)
        yield name, torch.zeros(2)


def test_a_distributed_push_on_a_rank_other_than_0_joins_the_gathers_and_sends_nothing():
    pusher = WeightPusher(rank=1, world_size=2, device=torch.device("cpu"))
    seen: list[str] = []
    out = pusher.push(
        None, "distributed", 3, named(seen), 1 << 20, False, "g", sleeps=False, model=None
    )
    assert out is None and seen == ["a", "b", "c"]
    assert pusher.broadcast is None and pusher.tensor is None


def test_an_unknown_transport_is_refused_with_the_ones_it_takes():
    pusher = WeightPusher(rank=0, world_size=1, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="'tensor' or 'distributed'"):
        pusher.push(None, "disk", 1, named([]), 1 << 20, False, "", sleeps=False, model=None)
