"""One train rank's pushes of the state it holds to an engine, over ``weights.transport``.

``WeightPusher`` is a collaborator the train actor owns, kept across updates:
the ``tensor`` transport's ``TensorPusher`` (``training.weight_sender``: staging
buffer, handles, what each engine takes), the ``distributed`` transport's
``BroadcastSender`` (``training.broadcast_sender``, rank 0 only) and the gloo
group over all train ranks that a tensor push gathers its handles on, each made
on first use. The actor hands it, per push, the version and the tensors to send,
whether the rank sleeps between pushes (colocated) and the model a staging
buffer may take over. Never decides which version to send and never gathers
shards itself (the caller's tensors are full on every rank).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from training.broadcast_sender import BroadcastSender
from training.weight_sender import HandleGather, TensorPusher, send_adapter

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightPusher:
    """A train rank's side of the in-memory transports (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.tensor: TensorPusher | None = None  # the ``tensor`` transport's state
        self.broadcast: BroadcastSender | None = None  # rank 0's broadcast groups
        self._gloo: Any = None  # a gloo group over all train ranks, made collectively

    def push(
        self,
        engine: Any,
        transport: str,
        version: int,
        named: NamedTensors,
        bucket_bytes: int,
        flush_cache: bool,
        group_name: str,
        *,
        sleeps: bool,
        model: torch.nn.Module | None,
        adapter: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """Collective: ``named`` (the same full tensors on every rank, iterated once)
        to ``engine`` as weight ``version``; rank 0 returns the summary. ``sleeps``:
        the rank frees its device memory between pushes (colocated), so it keeps no
        second copy of the model and streams. ``model``: a single rank's model, whose
        tensors a staging buffer may take over (None when sharded or converted).
        ``adapter``: ``named`` is a LoRA adapter in peft's names and this its peft
        config; it goes whole in one bucket (``training.weight_sender.send_adapter``),
        over the ``tensor`` transport only."""
        t0 = time.perf_counter()
        if adapter is not None:
            if transport != "tensor":
                raise ValueError(
                    f"transport={transport!r}: LoRA adapters are pushed over 'tensor' (or "
                    "loaded from disk); set weights.transport to tensor, disk or object-store"
                )
            if self.tensor is None:
                self.tensor = TensorPusher(self.device)
            ranks, wire = self.tensor.engine_profile(engine)
            gather = HandleGather(self.rank, self.world_size, ranks, self._gloo_group())
            out = send_adapter(engine, named, version, adapter, flush_cache, gather, wire)
        elif transport == "tensor":
            out = self._push_tensor(
                engine, version, named, bucket_bytes, flush_cache, sleeps, model
            )
        elif transport == "distributed":
            if self.rank != 0:
                for _ in named:  # join each all-gather; only rank 0 sends
                    pass
                return None
            if self.broadcast is None:
                self.broadcast = BroadcastSender()
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            out = self.broadcast.send(
                engine, named, version, bucket_bytes, flush_cache, group_name, backend
            )
        else:
            raise ValueError(
                f"transport={transport!r}: push_weights does 'tensor' or 'distributed'"
            )
        if out is None:
            return None
        return {"version": version, "transport": transport, "s": time.perf_counter() - t0, **out}

    def _push_tensor(
        self,
        engine: Any,
        version: int,
        named: NamedTensors,
        bucket_bytes: int,
        flush_cache: bool,
        sleeps: bool,
        model: torch.nn.Module | None,
    ) -> dict[str, Any] | None:
        if self.tensor is None:
            self.tensor = TensorPusher(self.device)
        ranks, wire = self.tensor.engine_profile(engine)
        gather = HandleGather(self.rank, self.world_size, ranks, self._gloo_group())
        # A rank that sleeps keeps no second copy of the model: it streams; so does a
        # push into SGLang, which opens the handles afresh each time.
        resident = not sleeps and wire != "sglang"
        return self.tensor.push(
            engine, named, version, bucket_bytes, flush_cache, gather, resident, model, wire
        )

    def _gloo_group(self) -> Any:
        """A gloo group over all train ranks (the handles of a tensor push travel on it
        even when training runs NCCL); None with one rank. Made once, collectively."""
        if self.world_size == 1:
            return None
        if self._gloo is None:
            self._gloo = dist.new_group(backend="gloo")
        return self._gloo
