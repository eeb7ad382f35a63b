"""What a train rank makes durable: checkpoints (save, load) and published HF
versions, written at once or in the background (``training.background_save``).

``DurableState`` is a collaborator the train actor owns. It holds what the
writes need of their own: the rank's place in the run (rank, world size, seed,
run name), the weights settings, the store the actor opens per fence, one
background writer for checkpoints and one for versions, and the reused host
buffers they copy into. What belongs to the backend comes in as a ``RankState``
of the actor's own callables (the megatron actor hands its gathers and its
checkpoint format); the model and base directory of a publish come with the call.
Never reads the actor, never decides when to save or which checkpoint to
restore, and imports no Prefect.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from training import checkpoint
from training.background_save import CHECKPOINT_LOST, VERSION_LOST, BackgroundSaver
from training.config import LoraConfig, WeightsConfig
from training.export import manifest_dict, write_adapter, write_hf_weights
from training.host_staging import HostStaging
from training.lora import peft_config


@dataclass(frozen=True)
class RankState:
    """How the durable writes reach one rank's backend state (the actor's methods)."""

    # Collective: the checkpoint's contents on rank 0, None elsewhere; (copy, staging),
    # where copy means no tensor may share memory with the live state.
    snapshot: Callable[[bool, HostStaging], dict | None]
    # Load checkpoint k of the store into the model and optimizer; returns its meta.
    restore: Callable[[Any, int], dict]
    # What this backend adds to a checkpoint's meta.
    meta: Callable[[], dict]
    # Collective: what a version publishes: the full state in HF names, tied output
    # dropped, or with LoRA the adapters in peft's names; a background publish passes
    # reused host buffers the backend may copy into.
    hf_state: Callable[[HostStaging | None], dict[str, torch.Tensor]]


class DurableState:
    """Checkpoints and published versions of one train rank (see module doc)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        seed: int,
        run_name: str,
        weights_cfg: WeightsConfig,
        store: Callable[[int | None], Any],
        state: RankState,
        lora: LoraConfig | None = None,
    ) -> None:
        """``lora``: versions are adapters of v0 (``storage.adapters``), not full weights."""
        self.rank, self.world_size, self.seed, self.run_name = rank, world_size, seed, run_name
        self.weights_cfg = weights_cfg
        self.lora = lora
        self.store = store  # the run store under a fence (the caller's lease), per call
        self.state = state
        self._checkpoints = BackgroundSaver("checkpoint", CHECKPOINT_LOST)
        self._versions = BackgroundSaver("weights version", VERSION_LOST)
        # Host buffers a checkpoint's snapshot (and a background publish's weights) are
        # copied into, reused by the next one once the last is written.
        self._checkpoint_staging = HostStaging()
        self._publish_staging = HostStaging()

    def load(self, k: int) -> int:
        """Restore model, optimizer and RNG of checkpoint ``k``; the iteration it holds."""
        meta = self.state.restore(self.store(None), k)
        return int(meta["iteration"])

    def save(
        self,
        k: int,
        meta_extra: dict | None = None,
        fence: int | None = None,
        background: bool = False,
        fail_background: bool = False,
    ) -> dict | None:
        """Collective. Rank 0 commits ``checkpoints/iter_k`` (fenced) and returns its meta.

        ``background``: the state is copied to host memory now and written by a
        thread (``training.background_save``); the meta says so and carries the
        failures of earlier background writes as ``warnings``. ``fail_background``
        fails that write on purpose (fault injection)."""
        warnings = self.wait()  # one write in flight at a time
        store = self.store(fence)
        if k in store.committed_checkpoints():  # committed checkpoints are never rewritten
            return store.read_checkpoint_meta(k) if self.rank == 0 else None
        meta = {"iteration": k, "weights_version": k, "seed": self.seed, **(meta_extra or {})}
        meta["world_size"] = self.world_size
        meta.update(self.state.meta())
        snap = self.state.snapshot(background, self._checkpoint_staging)
        if snap is None:
            return None
        if not background:
            return {**checkpoint.write(store, k, snap, meta), "warnings": warnings}
        self._checkpoints.start(k, lambda: checkpoint.write(store, k, snap, meta), fail_background)
        return {**meta, "background": True, "warnings": warnings}

    def wait(self) -> list[str]:
        """Wait for the background checkpoint write in flight; failures since last asked."""
        return self._checkpoints.wait()

    def publish(
        self,
        version: int,
        iteration: int,
        parent: int | None,
        model: torch.nn.Module,
        base_model_path: str,
        fence: int | None = None,
        background: bool = False,
    ) -> dict | None:
        """Collective. Rank 0 publishes ``weights/v{version}`` (fenced); returns a summary.

        ``model``: the live model a background copy must share no memory with;
        ``base_model_path``: where the config and tokenizer files come from.
        ``background``: the weights are copied to host memory now and written by a
        thread (for versions the engines receive in memory); the summary says so
        and carries the failures of earlier background publishes as ``warnings``."""
        warnings = self._versions.wait()
        store = self.store(fence)
        if version in store.committed_versions():  # a committed version is never rewritten
            return self._committed(store, version) if self.rank == 0 else None
        # collective: every rank takes part in the gather; a background publish's
        # copy lands in reused host buffers (the previous one is written: waited above)
        state = self.state.hf_state(self._publish_staging if background else None)
        if self.rank != 0:
            return None
        if not background:
            written = self._write_hf(store, state, version, iteration, parent, base_model_path)
            return {**written, "warnings": warnings}
        state = checkpoint.host_copy(state, model)
        write = partial(self._write_hf, store, state, version, iteration, parent, base_model_path)
        self._versions.start(version, write)
        return {
            "version": version,
            "iteration": iteration,
            "background": True,
            "warnings": warnings,
        }

    def _committed(self, store: Any, version: int) -> dict:
        """The summary of a version committed before (rank 0)."""
        manifest = manifest_dict(store.read_manifest(version))
        names = [f["name"] for f in manifest["files"]]
        return {
            "version": version,
            "iteration": manifest["iteration"],
            "parent": manifest["parent"],
            "files": names,
            "manifest": manifest,
            "shards": sum(n.endswith(".safetensors") for n in names),
            "reused": True,
        }

    def _base_cache(self) -> str | None:
        """weights.base_cache_dir for this run (None: the store's default)."""
        d = self.weights_cfg.base_cache_dir
        return None if d is None else os.path.join(d, self.run_name, "weights")

    def _write_hf(
        self,
        store: Any,
        state: dict,
        version: int,
        iteration: int,
        parent: int | None,
        base_model_path: str,
    ) -> dict:
        """Rank 0: write ``state`` as ``weights/v{version}`` and commit it (manifest last).
        With LoRA, ``state`` is the adapters: peft's two files, committed as an adapter of
        v0 (its manifest names v0 and the digest of v0's files)."""
        if self.lora is not None:
            writer = store.weights_writer(version, iteration, parent)
            written = write_adapter(writer, state, peft_config(self.lora, base_model_path))
            manifest = manifest_dict(writer.commit(adapter=store.adapter_of(0)))
        else:
            # delta on: XOR against the newest full version within full_every (storage.delta)
            every = self.weights_cfg.full_every if self.weights_cfg.delta == "on" else None
            writer = store.weights_writer(
                version, iteration, parent, full_every=every, base_cache_dir=self._base_cache()
            )
            written = write_hf_weights(writer, state, self.weights_cfg.shard_size, base_model_path)
            manifest = manifest_dict(writer.commit())
        return {
            "version": version,
            "iteration": iteration,
            "parent": parent,
            **written,
            "manifest": manifest,
        }
