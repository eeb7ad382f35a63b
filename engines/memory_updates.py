"""SGLang's in-memory weight-update API for the embedded engine (a mixin).

Owns ``update_weights_from_tensor`` (buckets handed over on the same host),
``init_weights_update_group`` / ``update_weights_from_distributed`` /
``destroy_weights_update_group`` (broadcast from trainer rank 0), the
``begin_weight_update`` / ``end_weight_update`` bracket, and ``state_sha256``
(for checking that a transport gives the same bytes as a disk reload).

Buckets are applied as they arrive, under the step lock; the caller pauses
generation first (the reload step pauses in place), so no forward sees a
half-updated model. The weight version changes only with the call that
carries ``weight_version`` (the last bucket), never before its tensors are in.
"""

from __future__ import annotations

import hashlib
from typing import Any

import ray
import torch

from engines import weight_receiver as wr
from engines.types import UpdateWeightsResult
from engines.weights import WeightLoadError

_control = ray.method(concurrency_group="control")


class InMemoryUpdates:
    """Mixed into EmbeddedEngine; uses its _model, _device, _cond, _step_lock."""

    _groups: dict[str, Any]
    _update_open: bool = False

    def _apply(
        self, named: list[tuple[str, torch.Tensor]], weight_version, flush_cache
    ) -> UpdateWeightsResult:
        try:
            with self._step_lock:
                nbytes = wr.copy_into(self._model, named)
                with self._cond:
                    if weight_version is not None:
                        self._weight_version = str(weight_version)
                    paused = self._inflight if self._parked else 0
        except WeightLoadError as e:
            return {"success": False, "message": str(e), "num_paused_requests": 0}
        if flush_cache:
            self.flush_cache()
        msg = f"copied {len(named)} tensors ({nbytes} bytes); version {self._weight_version}"
        return {"success": True, "message": msg, "num_paused_requests": paused}

    @_control
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
        named = []
        for handle in serialized_named_tensors:
            named.extend(wr.named_tensors(wr.open_bucket(handle, self._device)))
        result = self._apply(named, weight_version, flush_cache)
        del named  # drop the views of shared memory / IPC tensors before the producer frees them
        return result

    @_control
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
    ) -> dict[str, Any]:
        """Join the broadcast group of trainer rank 0 as rank ``rank_offset`` (this
        engine has one rank). A group of the same name is replaced."""
        if not hasattr(self, "_groups"):
            self._groups = {}
        self.destroy_weights_update_group(group_name)
        self._groups[group_name] = wr.make_group(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )
        return {"success": True, "message": f"joined {group_name} as rank {rank_offset}"}

    @_control
    def has_weights_update_group(self, group_name: str) -> bool:
        return group_name in getattr(self, "_groups", {})

    @_control
    def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        pg = getattr(self, "_groups", {}).pop(group_name, None)
        if pg is not None:
            wr.destroy_group(pg)
        return {"success": True, "message": f"{group_name} destroyed" if pg else "no such group"}

    @_control
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
        pg = getattr(self, "_groups", {}).get(group_name)
        if pg is None:
            raise RuntimeError(
                f"no weight-update group {group_name!r}: call init_weights_update_group first"
            )
        buckets = wr.receive_bucket(pg, wr.metadata_of(names, dtypes, shapes), self._device)
        return self._apply(wr.named_tensors(buckets), weight_version, flush_cache)

    @_control
    def begin_weight_update(self) -> dict[str, Any]:
        self._update_open = True
        return {"success": True, "message": "weight update begun"}

    @_control
    def end_weight_update(self) -> dict[str, Any]:
        self._update_open = False
        return {"success": True, "message": "weight update ended"}

    @_control
    def state_sha256(self) -> str:
        """sha256 over (name, dtype, shape, bytes) of the model's state dict, sorted by name."""
        h = hashlib.sha256()
        with self._step_lock:
            for name, t in sorted(self._model.state_dict().items()):
                t = t.detach().to("cpu").contiguous()
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
