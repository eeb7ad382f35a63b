"""LoRA adapters on the embedded engine (``AdapterMerge``, which the engine owns).

Owns SGLang's adapter API for this engine: ``load_lora_adapter`` (a peft folder,
verified against its manifest.json like any version folder),
``load_lora_adapter_from_tensors`` (one flattened bucket of peft's tensors) and
``unload_lora_adapter``. Unlike SGLang, which keeps several adapters beside its
base and lets each request pick one, this engine serves one adapter at a time,
merged into its weights: each adapted weight becomes base + scale * (B @ A)
(``wire.lora.merge``), computed from a copy of the base weight it keeps, so
loading adapter after adapter never drifts from the base. The cost is that copy:
the bytes of every adapted weight (with every linear layer a target, most of the
model), kept on the model's device and not released by a colocated sleep. Loading adapter
``v{k}`` makes the engine serve weight version ``k``: what it reports, and what
verify checks, is the adapter version.

An adapter applies only to its own base: the engine knows the digest of the full
weights it loaded (the manifest.json of the folder it started from or last loaded
in full; None for a folder without one), and an adapter whose manifest names
another base digest is refused, naming both (``storage.adapters``). A full weight
update (from disk or pushed) makes the new weights the base. The swap happens
under the step lock, between two decode steps; everything is read and checked
first, so a refused adapter leaves the old weights and version serving. One
rank only: an engine of several ranks refuses adapters.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engines.embedded.batching import Batcher
from engines.embedded.served_model import ServedModel
from engines.embedded.weight_files import read_adapter
from engines.types import UpdateWeightsResult
from storage.adapters import refuse_other_base
from storage.errors import StorageError
from wire import lora
from wire import receiver as wr
from wire.errors import WeightLoadError, WeightPathError

log = logging.getLogger(__name__)


class AdapterMerge:
    """The adapter one engine serves, merged into its weights; see the module docstring."""

    def __init__(self, served: ServedModel, batcher: Batcher, base_digest: str | None) -> None:
        self.served, self.batcher = served, batcher
        self.base_digest = base_digest  # of the full weights loaded last; None: unknown
        self.name: str | None = None  # the adapter served, e.g. "v3"; None: the base
        self._base: dict[str, torch.Tensor] = {}  # adapted weights as the base holds them
        self._base_version: str | None = None  # the version the base was served as

    def full_loaded(self, digest: str | None) -> None:
        """Full weights were loaded (caller holds the step lock): they are the base now."""
        self.base_digest, self.name = digest, None
        self._base, self._base_version = {}, None

    def load_from_disk(
        self, lora_name: str, lora_path: str, roots: tuple[str, ...] | None, flush_cache: bool
    ) -> UpdateWeightsResult:
        """Serve the adapter of the peft folder ``lora_path`` (verified against its
        manifest.json, which must name this engine's base) as ``lora_name``."""
        try:
            manifest, config, tensors = read_adapter(lora_path, roots)
            if manifest is not None:
                where = f"engine {self.served.version!r}'s base weights"
                refuse_other_base(manifest, self.base_digest, where)
            return self._serve(lora_name, config, tensors, flush_cache)
        except WeightPathError:
            raise
        except (WeightLoadError, StorageError, OSError, ValueError) as e:
            log.warning("refused adapter %s from %s: %s", lora_name, lora_path, e)
            return self._refused(str(e))

    def load_from_tensors(
        self,
        lora_name: str,
        config_dict: dict[str, Any],
        serialized_named_tensors: list[dict[str, Any]],
        load_format: str,
        flush_cache: bool,
        expected_checksums: dict[str, str] | None = None,
    ) -> UpdateWeightsResult:
        """Serve the adapter in one flattened bucket (one handle, this engine's one
        rank) as ``lora_name``, each tensor's sha256 checked against
        ``expected_checksums`` when given. The producer's memory is only read."""
        if load_format != "flattened_bucket":
            raise ValueError(f"load_format={load_format!r}: only 'flattened_bucket' is supported")
        if len(serialized_named_tensors) != 1:
            raise ValueError(
                f"got {len(serialized_named_tensors)} tensor handles; an engine that serves "
                "adapters has one rank: give one"
            )
        handle = wr.check_handle(serialized_named_tensors[0])
        try:
            named = wr.named_tensors(wr.open_bucket(handle, self.served.device))
            # copies: the views of the producer's memory are dropped on return
            tensors = {n: t.clone() for n, t in named}
            if expected_checksums is not None:
                lora.check_checksums(tensors, expected_checksums)
            return self._serve(lora_name, config_dict, tensors, flush_cache)
        except (WeightLoadError, ValueError) as e:
            return self._refused(str(e))

    def unload(self, lora_name: str) -> UpdateWeightsResult:
        """Stop serving ``lora_name``: the base weights and version are back. Unloading
        an adapter this engine does not serve changes nothing (it holds only one)."""
        served = self.served
        with served.step_lock:
            if self.name != lora_name:
                return {
                    "success": True,
                    "message": f"{lora_name} is not loaded",
                    "num_paused_requests": 0,
                }
            wr.copy_into(served.model, list(self._base.items()))
            with served.cond:
                served.version = str(self._base_version)
                paused = self.batcher.paused_requests()
            self.name = None
        msg = f"unloaded {lora_name}; serving version {served.version}"
        return {"success": True, "message": msg, "num_paused_requests": paused}

    def _serve(
        self,
        lora_name: str,
        config: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        flush_cache: bool,
    ) -> UpdateWeightsResult:
        version = lora.version_of(lora_name)
        served = self.served
        if served.ranks is not None:
            raise WeightLoadError(
                "this engine spans several ranks; the embedded engine applies LoRA adapters "
                "on one rank: set engines.tp_size: 1"
            )
        state = served.model.state_dict()
        wanted = {f"{m}.weight" for m in lora.pairs(tensors)}
        missing = sorted(wanted - set(state))
        if missing:
            raise WeightLoadError(f"the model has no {missing[:3]} for the adapter to change")
        with served.step_lock:
            # The base of every weight this adapter changes: the kept copy, or the weight
            # itself if no adapter changed it yet. All merged (and checked) before any copy.
            base = {n: self._base.get(n, state[n]) for n in wanted}
            merged = lora.merged_weights(base, tensors, config)
            for n in sorted(wanted - set(self._base)):
                self._base[n] = state[n].detach().clone()
            # weights the last adapter changed and this one does not: back to the base
            restore = [(n, t) for n, t in self._base.items() if n not in merged]
            wr.copy_into(served.model, restore + list(merged.items()))
            with served.cond:
                if self._base_version is None:
                    self._base_version = served.version
                served.version = str(version)
                paused = self.batcher.paused_requests()
            self.name = lora_name
        if flush_cache:
            self.batcher.flush_cache()
        msg = f"serving adapter {lora_name} ({len(merged)} weights) as version {version}"
        return {"success": True, "message": msg, "num_paused_requests": paused}

    def _refused(self, why: str) -> UpdateWeightsResult:
        with self.served.cond:
            paused = self.batcher.paused_requests()
        return {"success": False, "message": why, "num_paused_requests": paused}
