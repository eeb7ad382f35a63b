"""``RunStore``: everything of one run under ``{root}/{run}/``.

Layout::

    run.json                         config snapshot (no credentials)
    lease.json                       single-writer lease
    rollouts/iter_000012.json        persisted rollout batch
    checkpoints/iter_000012/...      trainer state + COMMIT (last)
    weights/v000012/...              HF files + manifest.json (last)
    ledger/iter_000012/<step>.json   committed step records
    metrics/iter_000012.json         one metrics row per iteration
    metrics.jsonl                    derived from metrics/*, rewritten whole
    engines/engine_000.json          version each engine serves

This is a thin facade: each concern lives in its own module (weights, pull,
checkpoints, ledger, lease, retention, integrity). It holds no cached state
but its ``fence``, so any number of processes may read while the lease holder
writes.

Fencing: a store built with ``fence=N`` (or that acquired the lease, which sets
it) reads lease.json before every commit it makes (ledger records, weights
manifest, checkpoint COMMIT, rollouts, metrics, serving records, gc
deletions, run.json) and raises ``LeaseLostError`` once another writer holds a
newer fence. ``fence=None`` (readers, tests, maintenance reads) skips the
check. See ``storage.lease`` for what the check does and does not guarantee.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from typing import Any, Literal

import fsspec

from storage import adapters as _adapters
from storage import checkpoints as _ckpt
from storage import delta as _delta
from storage import integrity as _integrity
from storage import lease as _lease
from storage import ledger as _ledger
from storage import pull as _pull
from storage import retention as _retention
from storage import weights as _weights
from storage.config import StorageConfig
from storage.errors import ManifestError, StorageError
from storage.fs import dumps, is_local, join, open_root, read_json, write_bytes
from storage.hashio import VerifyingReader
from storage.layout import LEASE_JSON, RUN_JSON, check_run_name, iter_name, version_name
from storage.types import AdapterOf, GcReport, Lease, Pulled, WeightsManifest

log = logging.getLogger("storage")

CheckpointWriter = _ckpt.CheckpointWriter
WeightsWriter = _weights.WeightsWriter
DeltaWriter = _delta.DeltaWriter

# The engines' default cache root (tasks.serving.engine.cache_dir); a publisher pulls an
# object-store base there, so a node that also runs engines keeps one copy of it.
_DEFAULT_CACHE = "~/.cache/prefect-rl"

# Env vars whose values must never be persisted (checked on run.json writes).
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")


class RunStore:
    """Reads and writes one run's state on any fsspec root (local disk, s3://, ...)."""

    def __init__(self, cfg: StorageConfig, run_name: str, fence: int | None = None):
        self.run_name = check_run_name(run_name)
        fs, root = open_root(cfg.root, cfg.s3)
        self.fs: fsspec.AbstractFileSystem = fs
        self.url = join(root, run_name)  # "{root}/{run}", never with credentials
        self._cfg = cfg
        self.fence = fence  # lease fence every commit is checked against; None: no check

    def check_fence(self) -> None:
        """Raise LeaseLostError unless this store's fence is the run's current one
        (no-op without a fence). Every commit below calls it first."""
        if self.fence is not None:
            _lease.check_fence(self.fs, self._p(LEASE_JSON), self.fence)

    # -- paths -------------------------------------------------------------------
    def _p(self, *parts: str) -> str:
        return join(self.url, *parts)

    @property
    def _weights_dir(self) -> str:
        return self._p("weights")

    @property
    def _ckpt_dir(self) -> str:
        return self._p("checkpoints")

    # -- run.json ----------------------------------------------------------------
    def exists(self) -> bool:
        return self.fs.exists(self._p(RUN_JSON))

    def write_run_json(self, data: dict[str, Any]) -> None:
        blob = dumps(data)
        text = blob.decode()
        for var in _SECRET_ENV:
            secret = os.environ.get(var, "")
            if len(secret) >= 8 and secret in text:
                raise StorageError(
                    f"run.json would contain the value of {var}; remove credentials from the config "
                    "(they are read from the environment and must never be stored)"
                )
        self.check_fence()
        write_bytes(self.fs, self._p(RUN_JSON), blob)

    def read_run_json(self) -> dict | None:
        return read_json(self.fs, self._p(RUN_JSON))

    # -- rollouts ----------------------------------------------------------------
    def rollouts_url(self, k: int) -> str:
        return self._p("rollouts", f"{iter_name(k)}.json")

    def write_rollouts(self, k: int, data: dict[str, Any]) -> str:
        """Persist iteration k's rollouts once; a committed batch is kept as is."""
        path = self.rollouts_url(k)
        try:
            blob = (json.dumps(data, allow_nan=False, separators=(",", ":")) + "\n").encode()
        except ValueError as e:
            raise StorageError(f"rollouts of iteration {k} are not JSON-able ({e})") from e
        self.check_fence()
        write_bytes(self.fs, path, blob, exclusive=True)
        return path

    def read_rollouts(self, k: int) -> dict | None:
        return read_json(self.fs, self.rollouts_url(k))

    # -- checkpoints -------------------------------------------------------------
    def checkpoint_writer(self, k: int) -> CheckpointWriter:
        return _ckpt.CheckpointWriter(self.fs, self._ckpt_dir, k, guard=self.check_fence)

    def committed_checkpoints(self) -> list[int]:
        return _ckpt.committed_checkpoints(self.fs, self._ckpt_dir)

    def read_checkpoint_meta(self, k: int) -> dict:
        return dict(_ckpt.read_commit(self.fs, self._ckpt_dir, k).meta)

    def checkpoint_files(self, k: int) -> list[str]:
        """The names of checkpoint k's files, as its COMMIT lists them."""
        return [f.name for f in _ckpt.read_commit(self.fs, self._ckpt_dir, k).files]

    def open_checkpoint_file(self, k: int, name: str) -> VerifyingReader:
        return _ckpt.open_checkpoint_file(self.fs, self._ckpt_dir, k, name)

    def verify_checkpoint(self, k: int) -> None:
        _ckpt.verify_checkpoint(self.fs, self._ckpt_dir, k)

    def checkpoint_url(self, k: int) -> str:
        return join(self._ckpt_dir, iter_name(k))

    # -- weights -----------------------------------------------------------------
    def weights_writer(
        self,
        version: int,
        iteration: int,
        parent: int | None,
        full_every: int | None = None,
        base_cache_dir: str | None = None,
    ) -> WeightsWriter | DeltaWriter:
        """A writer of ``weights/v{version}``. With ``full_every`` (``weights.delta: on``)
        a ``DeltaWriter`` against the newest full version fewer than ``full_every``
        versions back when there is one (``storage.delta.choose_base``), else a full
        writer. An object-store base is pulled (verified, once) into ``base_cache_dir``
        (default: the engines' default cache, ``~/.cache/prefect-rl/{run}/weights``)."""
        writer = _weights.WeightsWriter(
            self.fs,
            self._weights_dir,
            self.run_name,
            version,
            iteration,
            parent,
            guard=self.check_fence,
            # delta on: a full version written here is the next deltas' base
            on_commit=None if full_every is None else _delta.remember_committed,
        )
        if full_every is None:
            return writer
        try:
            base = _delta.choose_base(self.fs, self._weights_dir, version, full_every)
            if base is None:
                return writer
            base_dir = self.local_version_dir(base.version)
            if base_dir is None:
                cache = base_cache_dir or os.path.join(_DEFAULT_CACHE, self.run_name, "weights")
                base_dir = self.pull(base.version, cache).path
            return _delta.DeltaWriter(writer, base, base_dir)
        except BaseException:
            writer.abort()  # its staging folder is held; nothing was written yet
            raise

    def committed_versions(self) -> list[int]:
        return _weights.committed_versions(self.fs, self._weights_dir)

    def adapter_of(self, base: int = 0) -> AdapterOf:
        """What an adapter version trained on full version ``base`` records
        (``WeightsWriter.commit(adapter=...)``): ``base`` and its files' digest."""
        return _adapters.adapter_of(self.read_manifest(base))

    def latest_version(self) -> int | None:
        vs = self.committed_versions()
        return vs[-1] if vs else None

    def read_manifest(self, version: int) -> WeightsManifest:
        return _weights.read_manifest(self.fs, self._weights_dir, version)

    def version_state(self, version: int) -> Literal["committed", "absent", "damaged"]:
        """committed: manifest valid and every file present at its size; absent: nothing
        of it exists; damaged: anything else (logged with the reason). Cheap: no hashing."""
        state, why = _integrity.version_status(self.fs, self._weights_dir, version)
        if state == "damaged":
            log.warning("weights version %d is damaged: %s", version, why)
        return state

    def version_problem(self, version: int) -> str | None:
        """Why ``version_state`` is not "committed" (a sentence naming the file), or None."""
        state, why = _integrity.version_status(self.fs, self._weights_dir, version)
        return None if state == "committed" else why

    def discard_damaged_version(self, version: int) -> str:
        """Take a damaged version away so that it can be published again (a writer never
        rewrites a manifest that reads): its manifest first, then its files. Returns why
        it was damaged; StorageError, removing nothing, unless it is damaged. Holder only."""
        state, why = _integrity.version_status(self.fs, self._weights_dir, version)
        if state != "damaged":
            raise StorageError(
                f"weights {version_name(version)} of run {self.run_name!r} is {state}, not "
                "damaged: nothing was removed (only a damaged version is discarded)"
            )
        log.warning("discarding damaged weights version %d to republish it: %s", version, why)
        _retention.discard_version(self.fs, self._weights_dir, version, self.check_fence)
        return why

    def verify_version(self, version: int) -> WeightsManifest:
        """Hash every file of ``version`` against its manifest; IntegrityError naming the
        file and the fix on any difference, ManifestError when the manifest is bad."""
        return _integrity.verify_version(
            self.fs, self._weights_dir, version, self.read_manifest(version)
        )

    def version_url(self, version: int) -> str:
        return join(self._weights_dir, version_name(version))

    def local_version_dir(self, version: int) -> str | None:
        """The folder engines may load ``version`` from as is: the version folder on a
        local root, unless the version is a delta (its folder holds XOR files: ``pull``
        rebuilds it); None when it must be pulled."""
        if not is_local(self.fs):
            return None
        try:
            delta = self.read_manifest(version).delta
        except StorageError:
            delta = None  # not loadable at all: the loader's verify_dir names why
        return None if delta is not None else self.version_url(version)

    def materialize(self, version: int, dest: str) -> str:
        """Write ``version`` as a full HF folder at ``dest`` (a new local folder): the
        verified pull (a delta rebuilt from its base; an adapter version's peft folder as
        it is, which ``training.export.merge_adapter`` merges instead) into a private
        cache beside it, then renamed into place. Returns ``dest``."""
        dest = os.path.abspath(os.path.expanduser(dest))
        if os.path.exists(dest):
            raise StorageError(f"{dest} exists; materialize writes a new folder, pick another")
        cache = tempfile.mkdtemp(prefix=".tmp-materialize-", dir=os.path.dirname(dest) or ".")
        try:
            pulled = self.pull(version, cache).path
            for name in os.listdir(pulled):  # a local pull hard-links committed files:
                path = os.path.join(pulled, name)  # the user's folder gets its own bytes
                if os.path.isfile(path) and os.stat(path).st_nlink > 1:
                    shutil.copyfile(path, path + ".copy")
                    os.replace(path + ".copy", path)
            os.rename(pulled, dest)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        return dest

    def pull(
        self,
        version: int,
        cache_dir: str,
        workers: int = 8,
        retries: int = 3,
        verify_cached: bool = False,
    ) -> Pulled:
        """Make ``cache_dir/v000012`` a verified copy (once per cache, however many
        callers pull at once); ``verify_cached`` also hashes a reused copy and pulls it
        again if it changed (see storage.pull)."""
        manifest = self.read_manifest(version)
        if manifest.adapter is not None:  # never handed out for another base
            try:
                base: WeightsManifest | None = self.read_manifest(manifest.adapter.base)
            except ManifestError:
                base = None
            _adapters.check_base(manifest, base)
        return _pull.pull_version(
            self.fs, self.version_url(version), manifest, cache_dir, workers, retries, verify_cached
        )

    def pull_version(self, version: int, cache_dir: str, **kwargs: Any) -> str:
        """The path of ``pull``'s verified copy."""
        return self.pull(version, cache_dir, **kwargs).path

    # -- ledger, metrics, engines --------------------------------------------------
    def write_record(
        self, k: int, step: str, record: dict[str, Any], overwrite: bool = False
    ) -> None:
        _ledger.write_record(
            self.fs, self._p("ledger"), k, step, record, overwrite, guard=self.check_fence
        )

    def read_record(self, k: int, step: str) -> dict | None:
        return _ledger.read_record(self.fs, self._p("ledger"), k, step)

    def committed_steps(self, k: int) -> list[str]:
        return _ledger.committed_steps(self.fs, self._p("ledger"), k)

    def append_metrics(self, k: int, row: dict[str, Any]) -> None:
        _ledger.append_metrics(self.fs, self.url, k, row, guard=self.check_fence)

    def read_metrics(self) -> list[dict]:
        return _ledger.read_metrics(self.fs, self.url)

    def scan_metrics(self) -> tuple[list[dict], list[str]]:
        """(the metrics rows that read; the names of those that do not)."""
        return _ledger.scan_metrics(self.fs, self.url)

    def record_serving(self, engine_id: int, version: int) -> None:
        _ledger.record_serving(
            self.fs, self._p("engines"), engine_id, version, guard=self.check_fence
        )

    def serving_versions(self) -> dict[int, int]:
        return _ledger.serving_versions(self.fs, self._p("engines"))

    def scan_serving(self) -> tuple[dict[int, int], list[str]]:
        """(engine -> version of the serving records that read; the names of those that do not)."""
        return _ledger.scan_serving(self.fs, self._p("engines"))

    # -- lease -------------------------------------------------------------------
    def acquire_lease(
        self, owner: str, ttl_s: float, force: bool = False, wait: bool = True
    ) -> Lease:
        """Take the lease and fence this store with it; pass ``lease.fence`` to stores built
        elsewhere. Blocks up to the holder's ttl_s watching a possibly dead holder unless
        ``wait=False`` (then LeaseHeldError at once); see storage.lease."""
        lease = _lease.acquire_lease(self.fs, self._p(LEASE_JSON), owner, ttl_s, force, wait)
        self.fence = lease.fence
        return lease

    def renew_lease(self, owner: str, ttl_s: float) -> Lease:
        """LeaseLostError when this store's fence (if any) or ``owner`` no longer holds it."""
        return _lease.renew_lease(self.fs, self._p(LEASE_JSON), owner, ttl_s, self.fence)

    def release_lease(self, owner: str) -> None:
        """Mark the lease released (its fence is kept, so the next writer gets fence + 1)."""
        _lease.release_lease(self.fs, self._p(LEASE_JSON), owner, self.fence)

    def read_lease(self) -> Lease | None:
        return _lease.read_lease(self.fs, self._p(LEASE_JSON))

    # -- retention ---------------------------------------------------------------
    def gc(self, keep_last: int) -> GcReport:
        return _retention.gc(
            self.fs, self.url, keep_last, self.serving_versions(), guard=self.check_fence
        )


__all__ = ["RunStore", "CheckpointWriter", "DeltaWriter", "WeightsWriter"]
