"""Retention: which weight versions and checkpoints a run keeps.

Owns deletion. Rules: keep the last ``keep_last`` committed versions and
checkpoints; never delete a version an engine serves (engines/*.json) or one
a kept checkpoint points to (meta ``weights_version``), nor the base of a delta or
adapter version that is kept (``storage.delta``, ``storage.adapters``: one link, so no
chain to follow). v0 gets no special treatment. A commit marker is deleted FIRST, so a reader sees the version
either whole or absent, never torn. Local staging that no live writer holds
(``storage.staging``) goes too. Only the lease holder should call this.
"""

from __future__ import annotations

from collections.abc import Callable

import fsspec

from storage import staging
from storage.checkpoints import committed_checkpoints, read_commit
from storage.errors import ManifestError, StorageError
from storage.fs import is_local, join, ls_all, parse_iter_dirs, rm_file, rm_tree
from storage.layout import COMMIT, MANIFEST, iter_name, parse_version, version_name
from storage.types import GcReport
from storage.weights import STAGING_PREFIX, committed_versions, read_manifest


def gc(
    fs: fsspec.AbstractFileSystem,
    run_dir: str,
    keep_last: int,
    serving: dict[int, int],
    guard: Callable[[], None] | None = None,
) -> GcReport:
    """Delete what retention allows. ``guard`` runs before each deletion (the fence
    check), so a writer that lost the run stops deleting at once."""
    check = guard or (lambda: None)
    if keep_last < 1:
        raise StorageError(
            f"keep_last must be >= 1, got {keep_last}; retention never deletes everything"
        )
    wdir, cdir = join(run_dir, "weights"), join(run_dir, "checkpoints")
    versions = committed_versions(fs, wdir)
    ckpts = committed_checkpoints(fs, cdir)
    kept_c = ckpts[-keep_last:]
    keep_v = set(versions[-keep_last:])
    protected: dict[int, str] = {}
    for engine, v in sorted(serving.items()):
        if v not in keep_v and v in versions:
            protected.setdefault(v, f"served by engine {engine}")
    for k in kept_c:
        try:
            wv = read_commit(fs, cdir, k).meta.get("weights_version")
        except ManifestError:
            continue
        if isinstance(wv, int) and wv not in keep_v and wv in versions:
            protected.setdefault(wv, f"referenced by kept checkpoint {k}")
    keep_v |= set(protected)
    for v, (kind, base) in _bases(fs, wdir, sorted(keep_v)).items():
        if base not in keep_v and base in versions:
            protected.setdefault(base, f"base of kept {kind} version {v}")
    keep_v |= set(protected)

    deleted_v = [v for v in versions if v not in keep_v]
    for v in deleted_v:
        discard_version(fs, wdir, v, check)
    deleted_c = [k for k in ckpts if k not in kept_c]
    for k in deleted_c:
        d = join(cdir, iter_name(k))
        check()
        rm_file(fs, join(d, COMMIT))
        rm_tree(fs, d)

    debris = _debris(fs, wdir, cdir, versions, ckpts)
    for path in debris:
        check()
        rm_tree(fs, path)
    if is_local(fs):  # failed publishes' staging, whichever version and writer it was
        debris += staging.sweep(wdir, STAGING_PREFIX, guard=check)
    return GcReport(
        deleted_versions=deleted_v,
        deleted_checkpoints=deleted_c,
        kept_versions=[v for v in versions if v in keep_v],
        kept_checkpoints=kept_c,
        protected=protected,
        removed_debris=debris,
    )


def _bases(
    fs: fsspec.AbstractFileSystem, wdir: str, versions: list[int]
) -> dict[int, tuple[str, int]]:
    """delta or adapter version -> (its kind, its base), of ``versions``. A manifest that
    no longer reads is left out: that version is damaged, and deleting its base loses
    nothing more."""
    out = {}
    for v in versions:
        try:
            m = read_manifest(fs, wdir, v)
        except ManifestError:
            continue
        if m.delta is not None:
            out[v] = ("delta", m.delta.base)
        elif m.adapter is not None:
            out[v] = ("adapter", m.adapter.base)
    return out


def discard_version(
    fs: fsspec.AbstractFileSystem, wdir: str, version: int, guard: Callable[[], None]
) -> None:
    """Remove one version: its manifest first (readers see it absent, never torn), then
    its files. ``guard`` (the fence check) runs before anything is removed."""
    vdir = join(wdir, version_name(version))
    guard()
    rm_file(fs, join(vdir, MANIFEST))
    rm_tree(fs, vdir)


def _debris(
    fs: fsspec.AbstractFileSystem, wdir: str, cdir: str, versions: list[int], ckpts: list[int]
) -> list[str]:
    """Uncommitted folders older than the newest commit (a failed publish/save). Newer
    ones may be in progress."""
    out = []
    newest_v = versions[-1] if versions else -1
    for name in ls_all(fs, wdir):
        v = parse_version(name)
        if v is not None and v < newest_v and v not in versions:
            out.append(join(wdir, name))
    newest_c = ckpts[-1] if ckpts else -1
    for k in parse_iter_dirs(ls_all(fs, cdir)):
        if k < newest_c and k not in ckpts:
            out.append(join(cdir, iter_name(k)))
    return out
