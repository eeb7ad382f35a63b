"""SGLang's in-memory weight-update API for the embedded engine (``InMemoryUpdates``, which it owns).

Owns ``update_weights_from_tensor`` (buckets handed over on the same host),
``init_weights_update_group`` / ``update_weights_from_distributed`` /
``destroy_weights_update_group`` (broadcast from trainer rank 0), the
``begin_weight_update`` / ``end_weight_update`` bracket, ``update_socket``
(the same-host signal for cached updates, ``wire.update_socket``) and
``state_sha256`` (for checking that a transport gives the same bytes as a disk
reload).

It is handed the engine's ``ServedModel`` (model, ranks, version, locks) and
its ``Batcher`` (paused requests, cache flushes) at construction, and holds
what only updates need: the broadcast groups joined, the update socket and the
cache of opened staging handles (``engines.embedded.weight_cache``).

Buckets are applied as they arrive, under the step lock; the caller pauses
generation first (the reload step pauses in place), so no forward sees a
half-updated model. The weight version changes only with the call that
carries ``weight_version`` (the last bucket), never before its tensors are in.

An engine spanning several ranks (``engines.embedded.engine_ranks``) applies each
bucket on every rank, each taking its tensor-parallel slice: rank j opens
``serialized_named_tensors[j]`` (SGLang's rule), and for broadcasts every
rank joins the trainer's group as ``rank_offset + j`` and receives.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import ray
import torch

from engines.embedded import tensor_parallel as tpar
from engines.embedded.batching import Batcher
from engines.embedded.engine_ranks import wait_all
from engines.embedded.served_model import ServedModel
from engines.embedded.weight_cache import CacheMiss, ReceiverCache
from engines.types import UpdateWeightsResult
from wire import receiver as wr
from wire.errors import WeightLoadError
from wire.update_socket import UpdateSocket


class InMemoryUpdates:
    """Tensor and broadcast weight updates of one engine; see the module docstring."""

    def __init__(
        self,
        served: ServedModel,
        batcher: Batcher,
        tp_size: int,
        on_weights: Callable[[str | None], None] | None = None,
    ) -> None:
        """``on_weights(None)`` is called under the step lock after every update copied
        in: pushed full weights are the engine's base now, of no known digest."""
        self.served = served
        self._on_weights = on_weights or (lambda digest: None)
        self.batcher = batcher
        self.tp_size = tp_size
        self.groups: dict[str, Any] = {}  # broadcast groups joined, by name
        self.cache = ReceiverCache()  # rank 0's opened staging handles, kept across updates
        self._socket: UpdateSocket | None = None  # started at the first update_socket()
        self._update_open = False  # between begin_weight_update and end_weight_update

    def _apply(
        self,
        copy: Callable[[], tuple[int, int]],
        weight_version: str | None,
        flush_cache: bool,
    ) -> UpdateWeightsResult:
        """Run ``copy`` (copies one bucket on every rank; returns tensors and bytes
        of rank 0) under the step lock, then set the version if given."""
        served = self.served
        try:
            with served.step_lock:
                ntensors, nbytes = copy()
                self._on_weights(None)
                with served.cond:
                    if weight_version is not None:
                        served.version = str(weight_version)
                    paused = self.batcher.paused_requests()
        except WeightLoadError as e:  # a cache miss asks the producer to resend in full
            miss = isinstance(e, CacheMiss) or "weight cache miss" in str(e)
            return {
                "success": False,
                "message": str(e),
                "num_paused_requests": 0,
                "cache_miss": miss,
            }
        if flush_cache:
            self.batcher.flush_cache()
        msg = f"copied {ntensors} tensors ({nbytes} bytes); version {served.version}"
        return {"success": True, "message": msg, "num_paused_requests": paused}

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[dict[str, Any]],
        load_format: str = "flattened_bucket",
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> UpdateWeightsResult:
        """Copy the buckets behind ``serialized_named_tensors`` (handles made by
        ``training.weight_sender``) into the model. The producer's memory is only
        read; it frees it once this call has returned."""
        if load_format != "flattened_bucket":
            raise ValueError(f"load_format={load_format!r}: only 'flattened_bucket' is supported")
        tp = self.tp_size
        if len(serialized_named_tensors) != tp:
            raise ValueError(
                f"got {len(serialized_named_tensors)} tensor handles for an engine of tp_size={tp}: "
                "give one per rank (rank j loads handle j)"
            )
        handles = [wr.check_handle(h) for h in serialized_named_tensors]
        served = self.served

        def copy() -> tuple[int, int]:
            refs = []
            if served.ranks is not None:
                refs = served.ranks.submit_each("apply_handle", [(h,) for h in handles[1:]])
            # Views of the producer's memory are dropped (or kept, for a cached
            # handle) before this returns; the producer frees or reuses it after.
            out = self.cache.apply(served.model, handles[0], served.device, 0, tp)
            wait_all(refs)
            return out

        return self._apply(copy, weight_version, flush_cache)

    def update_socket(self) -> dict[str, Any] | None:
        """Where a producer on this host signals cached updates (the socket starts on
        the first ask); None for an engine of several ranks, whose ranks are each
        their own process and take every update over Ray."""
        if self.served.ranks is not None:
            return None
        if self._socket is None:
            self._socket = UpdateSocket(self._update_cached)
        return self._socket.address()

    def _update_cached(
        self, channel: str, key: str, flush_cache: bool, weight_version: str | None
    ) -> UpdateWeightsResult:
        """``update_weights_from_tensor`` of a handle this engine holds open, asked over
        the socket: the handle names the cached buffer and nothing else, so a key this
        engine does not hold is a cache miss (the producer resends in full over Ray)."""
        handle = {
            "cache": {"channel": channel, "key": key, "keep": True},
            "parts": [{"metadata": None}],
        }
        served = self.served
        copy = lambda: self.cache.apply(served.model, handle, served.device, 0, 1)  # noqa: E731
        return self._apply(copy, weight_version, flush_cache)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
    ) -> dict[str, Any]:
        """Join the broadcast group of trainer rank 0: rank j of this engine as
        ``rank_offset + j``. A group of the same name is replaced."""
        self.destroy_weights_update_group(group_name)
        joins = []
        if self.served.ranks is not None:
            joins = self.served.ranks.submit_each(
                "join_update_group",
                [
                    (master_address, master_port, rank_offset + j, world_size, group_name, backend)
                    for j in range(1, self.tp_size)
                ],
            )
        self.groups[group_name] = wr.make_group(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )
        wait_all(joins)
        return {"success": True, "message": f"joined {group_name} as rank {rank_offset}"}

    def has_weights_update_group(self, group_name: str) -> bool:
        return group_name in self.groups

    def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        pg = self.groups.pop(group_name, None)
        if pg is not None:
            wr.destroy_group(pg)
            if self.served.ranks is not None:
                ray.get(self.served.ranks.submit("leave_update_group", group_name))
        return {"success": True, "message": f"{group_name} destroyed" if pg else "no such group"}

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> UpdateWeightsResult:
        """Receive one bucket by broadcast from rank 0 of ``group_name`` (one flat
        tensor per dtype, first-seen dtype order) and copy it into the model."""
        pg = self.groups.get(group_name)
        if pg is None:
            raise RuntimeError(
                f"no weight-update group {group_name!r}: call init_weights_update_group first"
            )
        metas = wr.metadata_of(names, dtypes, shapes)
        served = self.served

        def copy() -> tuple[int, int]:
            # Every rank receives the same broadcast; the step lock is held from
            # before it, so no forward runs on a half-received model.
            refs = []
            if served.ranks is not None:
                refs = served.ranks.submit("receive_update", group_name, metas)
            named = wr.named_tensors(wr.receive_bucket(pg, metas, served.device))
            nbytes = wr.copy_into(served.model, tpar.shard_named(named, 0, self.tp_size))
            wait_all(refs)
            return len(named), nbytes

        return self._apply(copy, weight_version, flush_cache)

    def begin_weight_update(self) -> dict[str, Any]:
        self._update_open = True
        return {"success": True, "message": "weight update begun"}

    def end_weight_update(self) -> dict[str, Any]:
        self._update_open = False
        return {"success": True, "message": "weight update ended"}

    def state_sha256(self) -> str:
        """sha256 over (name, dtype, shape, bytes) of the model's state dict, sorted by name."""
        h = hashlib.sha256()
        served = self.served
        with served.step_lock:
            state = {n: t.detach().to("cpu") for n, t in served.model.state_dict().items()}
            if served.ranks is not None:  # the full tensors, as a single-rank engine holds them
                state = served.ranks.gather_state(state)
            for name, t in sorted(state.items()):
                t = t.detach().to("cpu").contiguous()
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
