"""Published versions as the ledger sees them: which one is the newest published at
an iteration, making one the ledger calls published readable again, and
publishing a committed checkpoint as a version (the publish-weights flow).

The ledger, not the listing of committed versions, says what is published: a
version whose manifest is missing or damaged is republished from trainer state
(or refused loudly), never silently replaced by an older one. Imports nothing of
``tasks.serving``: the transports above it ask it which version to serve.
"""

from __future__ import annotations

import logging
from typing import Any

from tasks import colocate

log = logging.getLogger("prefect_rl.engines")


def expected_version(ctx, k: int) -> int:
    """The version rollout k must be generated with: the newest one <= k-1 that
    the ledger records as published (v0, the base model, is published by
    prepare_run). Taken from the ledger, not from the listing of committed
    versions: a published version whose manifest is missing or damaged is
    republished (or refused), never silently replaced by an older one."""
    v = newest_published(ctx, k - 1)
    ensure_published(ctx, v)
    return v


def adapter_base(ctx, v: int) -> int | None:
    """The full version committed version v is a LoRA adapter of (``train.lora``); None
    for a full version. From its manifest: storage, not the config, says what v is."""
    adapter = ctx.store.read_manifest(v).adapter
    return None if adapter is None else adapter.base


def newest_published(ctx, k: int) -> int:
    """The newest version <= k whose publish step the ledger records as published; 0 if none."""
    for j in range(k, 0, -1):
        record = ctx.store.read_record(j, "publish")
        if record is not None and record["result"].get("published"):
            return j
    return 0


def ensure_published(ctx, v: int) -> None:
    """Make the version the ledger calls published readable again: republish it
    (v0 from the base model, v >= 1 from trainer state v, rebuilt from a
    checkpoint and the persisted rollouts), or fail naming the version and the fix.
    A version damaged under a manifest that still reads (a shard cut short) is
    discarded once state v is rebuilt, then published again."""
    store = ctx.store
    state = store.version_state(v)
    if state == "committed":
        return
    why, url = store.version_problem(v), store.version_url(v)
    # A writer never rewrites a manifest that reads (committed versions are immutable):
    # such a version must be taken away before it can be published again.
    in_place = _manifest_reads(store, v)
    log.warning(
        "weights v%d of run %r is %s (%s) although the ledger records it as published; republishing it",
        v,
        ctx.run_name,
        state,
        why,
    )
    try:
        if v == 0:
            from tasks.prepare import publish_base

            if in_place:
                store.discard_damaged_version(v)
            publish_base(ctx)
        else:
            colocate.for_training(ctx)  # the trainer needs the devices to rebuild state v
            trainer = ctx.trainer()
            trainer.ensure_state(v, ctx.base_model_path)
            if in_place:  # only now: had state v not been rebuilt, the folder stays as it was
                store.discard_damaged_version(v)
            trainer.export_hf(v, v, newest_published(ctx, v - 1))
    except Exception as e:
        raise RuntimeError(
            f"weights v{v} of run {ctx.run_name!r} ({url}) is {state} ({why}) although the "
            f"ledger records it as published, and republishing it from trainer state {v} "
            f"failed ({e}); restore the version folder from a backup, or rerun once the cause "
            "above is fixed"
        ) from e
    if store.version_state(v) != "committed":
        raise RuntimeError(
            f"weights v{v} of run {ctx.run_name!r} is still not committed after republishing it "
            f"({store.version_problem(v)}); check storage at {url}"
        )


def _manifest_reads(store, v: int) -> bool:
    from storage.errors import StorageError

    try:
        store.read_manifest(v)
    except StorageError:
        return False
    return True


def publish_checkpoint(ctx, k: int) -> dict[str, Any]:
    """Publish committed checkpoint k as weights/v{k} (trainer state k restored from
    it first); a version already committed is only described. Its ``warnings`` (a
    corrupt checkpoint skipped on the way) are the caller's to show."""
    store = ctx.store
    warnings: list[str] = []
    if k not in store.committed_versions():
        trainer = ctx.trainer()
        warnings = list((trainer.ensure_state(k, ctx.base_model_path) or {}).get("warnings") or [])
        trainer.export_hf(k, k, store.latest_version())
    manifest = store.read_manifest(k)
    out = {
        "version": k,
        "url": store.version_url(k),
        "files": len(manifest.files),
        "published": True,
    }
    return {**out, "warnings": warnings} if warnings else out
