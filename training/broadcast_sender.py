"""Trainer rank 0's side of the ``distributed`` transport: broadcast groups, one per engine.

Metadata goes by actor call, tensors by broadcast over a standalone process
group {trainer rank 0, engine rank(s)} (gloo on CPU, NCCL on GPU), one group per
engine so each engine's reload is its own retriable task. A group whose engine
has lost it (restarted) is torn down and rebuilt. The weight version is set by
the call carrying the last bucket.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import ray
import torch

from wire import receiver as wr
from wire import sglang_payload
from wire.flat_bucket import flatten, iter_buckets

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def _with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


def _check(reply: dict[str, Any], what: str) -> None:
    if not reply.get("success"):
        raise RuntimeError(f"engine refused {what}: {reply.get('message')}")


class BroadcastSender:
    """Trainer rank 0's broadcast groups, one per engine, by group name."""

    def __init__(self) -> None:
        self.groups: dict[str, Any] = {}
        self.wires: dict[str, str] = {}  # group -> its engine's layout ("embedded" | "sglang")

    def ensure_group(self, engine: Any, group_name: str, backend: str) -> Any:
        pg = self.groups.get(group_name)
        if pg is not None and ray.get(engine.has_weights_update_group.remote(group_name)):
            return pg
        if pg is not None:  # the engine was restarted: its end of the group is gone
            wr.destroy_group(self.groups.pop(group_name))
        addr, port = ray.util.get_node_ip_address(), wr.free_port()
        info = ray.get(engine.model_info.remote())
        self.wires[group_name] = info.get("weight_wire", "embedded")
        world = 1 + int(info.get("tp_size", 1))  # + trainer rank 0
        joined = engine.init_weights_update_group.remote(addr, port, 1, world, group_name, backend)
        pg = wr.make_group(addr, port, 0, world, group_name, backend)
        _check(ray.get(joined), f"init_weights_update_group({group_name})")
        self.groups[group_name] = pg
        return pg

    def send(
        self,
        engine: Any,
        named: NamedTensors,
        version: int,
        bucket_bytes: int,
        flush_cache: bool,
        group_name: str,
        backend: str,
    ) -> dict[str, Any]:
        pg = self.ensure_group(engine, group_name, backend)
        nbytes = nbuckets = 0
        sglang = self.wires.get(group_name) == "sglang"
        for bucket, last in _with_last(iter_buckets(named, bucket_bytes)):
            flats = flatten(bucket)
            if sglang:  # one flat uint8 broadcast, in SGLang's order (wire.sglang_payload)
                flats = sglang_payload.ordered(flats)
            metas = [m for b in flats for m in b.metadata]
            reply_ref = engine.update_weights_from_distributed.remote(
                [m.name for m in metas],
                [m.dtype for m in metas],
                [list(m.shape) for m in metas],
                group_name=group_name,
                flush_cache=flush_cache and last,
                weight_version=str(version) if last else None,
            )
            for flat in (
                [sglang_payload.broadcast_flat(flats)] if sglang else [b.flat for b in flats]
            ):
                wr.broadcast(pg, flat.contiguous())
            _check(ray.get(reply_ref), f"bucket {nbuckets} of v{version}")
            nbytes += sum(b.flat.numel() * b.flat.element_size() for b in flats)
            nbuckets += 1
        return {"bytes": nbytes, "buckets": nbuckets}

    def close(self) -> None:
        for pg in self.groups.values():
            wr.destroy_group(pg)
        self.groups.clear()
