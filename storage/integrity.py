"""Integrity checks of weight versions: is a version committed, absent or damaged,
and do its bytes still match the manifest.

Owns the checks a loader runs before trusting a folder: ``verify_dir`` for a
local folder (a pulled cache dir or a local version dir, as engines load it),
``version_status`` (cheap: manifest + sizes) and ``verify_version`` (every
byte) for a version in the store. Must never modify or repair anything: the
fix is always to republish or re-pull, which callers decide.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import fsspec

from storage import tree
from storage.errors import IntegrityError, ManifestError
from storage.fs import is_local, join, ls_all, read_bytes
from storage.hashio import hash_stream
from storage.layout import MANIFEST, TMP_PREFIX, parse_version, version_name
from storage.manifests import parse_manifest
from storage.types import FileEntry, WeightsManifest

VersionState = Literal["committed", "absent", "damaged"]

# Files hashed at once by verify_dir: hashlib and reads release the GIL.
_VERIFY_THREADS = 4


def verify_dir(dir: str) -> WeightsManifest | None:
    """Check every file of a local weights folder against its own ``manifest.json``.

    Returns None when the folder has no manifest (it was never a committed copy),
    else the manifest once each file's size and hashes match: its chunk hashes and
    their root, hashed on every core (``storage.tree``), or its sha256 for an entry
    written before trees. Names must stay inside the folder: absolute names and
    '..' are refused by the manifest schema, and symlinks that resolve outside
    the folder are refused here. Raises IntegrityError / ManifestError (both
    StorageError) naming the file and the fix.
    """
    root = os.path.realpath(dir)
    mpath = os.path.join(dir, MANIFEST)
    if not os.path.lexists(mpath):
        return None
    _inside(root, dir, MANIFEST, None)
    with open(mpath, "rb") as f:
        data = f.read()
    folder_version = parse_version(os.path.basename(os.path.normpath(dir)))
    try:
        m = parse_manifest(data, mpath, folder_version)
    except ManifestError as e:
        raise ManifestError(f"{e}; {_fix(folder_version)}") from e
    if m.delta is not None:
        raise IntegrityError(
            f"{dir} holds version {m.version} as a delta of v{m.delta.base} (XOR files, not "
            "weights); load it through a pull (RunStore.pull rebuilds and verifies it) or "
            "materialize it (prefect-rl materialize)"
        )
    for entry in m.files:
        _inside(root, dir, entry.name, m.version)
    # Trees hash their chunks on every core; sha256-only files take a thread each.
    with ThreadPoolExecutor(max(1, min(_VERIFY_THREADS, len(m.files)))) as pool:
        for fut in [pool.submit(_check_local_file, dir, e, m.version) for e in m.files]:
            fut.result()
    return m


def _fix(version: int | None) -> str:
    return f"republish or re-pull version {version if version is not None else '(this one)'}"


def _inside(root: str, dir: str, name: str, version: int | None) -> None:
    """A name (or a symlink on its path) that resolves outside the folder would make a
    loader read files nobody committed."""
    real = os.path.realpath(os.path.join(dir, name))
    if not real.startswith(root + os.sep):
        raise IntegrityError(
            f"{name!r} in {dir} resolves to {real}, outside the folder (a symlink escape?); "
            f"{_fix(version)}"
        )


def _check_local_file(dir: str, entry: FileEntry, version: int) -> None:
    why = tree.check_local(os.path.join(dir, entry.name), entry)
    if why is not None:
        raise IntegrityError(f"{entry.name!r} in {dir}: {why}; {_fix(version)}")


def version_status(
    fs: fsspec.AbstractFileSystem, weights_dir: str, version: int
) -> tuple[VersionState, str]:
    """(state, why). Cheap: the manifest, one listing for sizes, no hashing.

    ``damaged``: a version folder or staging exists without a manifest, the manifest
    does not parse or validate, or a listed file is missing or has the wrong size. A
    publish in progress also reads as damaged: ask only about versions whose publish
    is recorded as done.
    """
    vname = version_name(version)
    vdir = join(weights_dir, vname)
    mpath = join(vdir, MANIFEST)
    data = read_bytes(fs, mpath)
    if data is None:
        staging = [n for n in ls_all(fs, weights_dir) if n.startswith(f"{TMP_PREFIX}{vname}-")]
        if staging or fs.exists(vdir):
            return "damaged", f"{vdir} has files but no {MANIFEST} (a failed or torn publish)"
        return "absent", f"{vdir} does not exist"
    try:
        m = parse_manifest(data, mpath, version)
    except ManifestError as e:
        return "damaged", str(e)
    sizes = _sizes(fs, vdir)
    for f in m.files:
        got = sizes.get(f.name)
        if got != f.bytes:
            what = "is missing" if got is None else f"has {got} bytes, manifest says {f.bytes}"
            return "damaged", f"{f.name!r} of {vdir} {what}"
    # Unreadable (a delta) or unservable (an adapter) without its base: retention keeps it.
    for kind, of in (("delta", m.delta), ("adapter", m.adapter)):
        if of is not None and not fs.exists(join(weights_dir, version_name(of.base), MANIFEST)):
            return "damaged", f"{vdir} is {kind} of v{of.base}, whose {MANIFEST} is missing"
    return "committed", ""


def _sizes(fs: fsspec.AbstractFileSystem, vdir: str) -> dict[str, int]:
    """name -> size of every file under ``vdir``: one listing, also on S3."""
    base = fs._strip_protocol(vdir).rstrip("/") + "/"
    out = {}
    for path, info in fs.find(vdir, detail=True).items():
        p = fs._strip_protocol(path)
        if p.startswith(base) and info.get("type", "file") == "file":
            out[p[len(base) :]] = int(info["size"])
    return out


def verify_version(
    fs: fsspec.AbstractFileSystem, weights_dir: str, version: int, manifest: WeightsManifest
) -> WeightsManifest:
    """Hash every file of a stored version against ``manifest`` (its tree, or its
    sha256 for an entry written before trees); IntegrityError on the first file that
    differs or is missing."""
    vdir = join(weights_dir, version_name(version))
    fix = f"republish version {version} (publish-weights) or roll engines back to an older version"
    for entry in manifest.files:
        path = join(vdir, entry.name)
        if is_local(fs):
            why = tree.check_local(path, entry)
        else:
            try:
                why = _check_remote(fs, path, entry)
            except FileNotFoundError:
                why = "missing"
        if why is not None:
            raise IntegrityError(f"{entry.name!r} of {vdir}: {why}; {fix}")
    return manifest


def _check_remote(fs: fsspec.AbstractFileSystem, path: str, entry: FileEntry) -> str | None:
    with fs.open(path, "rb", block_size=8 << 20) as f:
        if entry.tree is not None:
            n, digests = tree.stream_digests(f, entry.tree.chunk)
            if n != entry.bytes:
                return f"has {n} bytes, the manifest says {entry.bytes}"
            return tree.problem(entry, digests)
        n, sha = hash_stream(f)
    if n != entry.bytes or sha != entry.sha256:
        return (
            f"sha256 {sha[:12]}... ({n} bytes), the manifest says sha256 "
            f"{entry.sha256[:12]}... ({entry.bytes} bytes)"
        )
    return None
