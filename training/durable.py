"""What a train rank makes durable: checkpoints (save, load) and published HF
versions, written at once or in the background (``training.background_save``).

A mixin of ``TrainActor``: it uses the rank's model, optimizer, store and
iteration, and ``_hf_state`` (the full state in HF names, which the megatron
actor overrides). Imports no Prefect.
"""

from __future__ import annotations

import os
from typing import Any

from training import checkpoint
from training.export import manifest_dict, write_hf_weights


class DurableState:
    """Checkpoints and published versions of one train rank (see module doc)."""

    def load_checkpoint(self, k: int) -> int:
        """Restore model, optimizer and RNG of checkpoint ``k`` (after init_from_base)."""
        self._require_model()
        meta = checkpoint.load(self.store(), k, self.model, self.optim)
        self._iteration = int(meta["iteration"])
        return self._iteration

    def save_checkpoint(
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
        self._require_at(k, "save_checkpoint")
        warnings = self.wait_saved()  # one write in flight at a time
        store = self.store(fence)
        if k in store.committed_checkpoints():  # committed checkpoints are never rewritten
            return store.read_checkpoint_meta(k) if self.rank == 0 else None
        meta = {"iteration": k, "weights_version": k, "seed": self.seed, **(meta_extra or {})}
        meta["world_size"] = self.world_size
        meta.update(self._checkpoint_meta())
        snap = self._checkpoint_snapshot(copy=background)
        if snap is None:
            return None
        if not background:
            return {**checkpoint.write(store, k, snap, meta), "warnings": warnings}
        self._saver.start(k, lambda: checkpoint.write(store, k, snap, meta), fail_background)
        return {**meta, "background": True, "warnings": warnings}

    def _checkpoint_snapshot(self, copy: bool) -> dict | None:
        """Collective: the checkpoint's contents on rank 0 (the megatron actor gathers
        its TP shards instead)."""
        return checkpoint.snapshot(
            self.model, self.optim, self.rank, copy=copy, staging=self._host_staging
        )

    def _checkpoint_meta(self) -> dict:
        """What this backend adds to a checkpoint's meta."""
        return {}

    def wait_saved(self) -> list[str]:
        """Wait for the background checkpoint write in flight; failures since last asked."""
        return self._saver.wait()

    def export_hf(
        self,
        version: int,
        iteration: int,
        parent: int | None,
        fence: int | None = None,
        background: bool = False,
    ) -> dict | None:
        """Collective. Rank 0 publishes ``weights/v{version}`` (fenced); returns a summary.

        ``background``: the weights are copied to host memory now and written by a
        thread (for versions the engines receive in memory); the summary says so
        and carries the failures of earlier background publishes as ``warnings``."""
        self._require_model()
        warnings = self._publisher.wait()
        store = self.store(fence)
        if version in store.committed_versions():  # a committed version is never rewritten
            if self.rank != 0:
                return None
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
        # collective: every rank takes part in the gather; a background publish's
        # copy lands in reused host buffers (the previous one is written: waited above)
        state = self._hf_state(self._publish_staging if background else None)
        if self.rank != 0:
            return None
        if background:
            state = checkpoint.host_copy(state, self.model)
            target = (store, state, version, iteration, parent)
            self._publisher.start(version, lambda: self._write_hf(*target))
            return {
                "version": version,
                "iteration": iteration,
                "background": True,
                "warnings": warnings,
            }
        return {**self._write_hf(store, state, version, iteration, parent), "warnings": warnings}

    def _base_cache(self) -> str | None:
        """weights.base_cache_dir for this run (None: the store's default)."""
        d = self.weights_cfg.base_cache_dir
        return None if d is None else os.path.join(d, self.run_name, "weights")

    def _write_hf(
        self, store: Any, state: dict, version: int, iteration: int, parent: int | None
    ) -> dict:
        """Rank 0: write ``state`` as ``weights/v{version}`` and commit it (manifest last)."""
        # delta on: XOR against the newest full version within full_every (storage.delta)
        every = self.weights_cfg.full_every if self.weights_cfg.delta == "on" else None
        writer = store.weights_writer(
            version, iteration, parent, full_every=every, base_cache_dir=self._base_cache()
        )
        written = write_hf_weights(writer, state, self.weights_cfg.shard_size, self.base_model_path)
        manifest = manifest_dict(writer.commit())
        return {
            "version": version,
            "iteration": iteration,
            "parent": parent,
            **written,
            "manifest": manifest,
        }
