"""Reading and validating weight manifests (``weights/v000012/manifest.json``).

Owns the reader's side of the weights commit rule: a version exists iff its
manifest exists and parses. Must not write anything.
"""

from __future__ import annotations

import json
import logging

import fsspec
from pydantic import ValidationError

from storage.errors import ManifestError
from storage.fs import join, ls_names, read_bytes
from storage.layout import MANIFEST, parse_version, version_name
from storage.types import WeightsManifest

log = logging.getLogger("storage")


def parse_manifest(data: bytes | None, where: str, version: int | None = None) -> WeightsManifest:
    """Validate manifest bytes; every failure is a ManifestError naming ``where``."""
    if data is None:
        raise ManifestError(
            f"{where} is missing: the version was never committed (or is being deleted)"
        )
    try:
        raw = json.loads(data)
    except ValueError as e:
        raise ManifestError(f"{where} is not valid JSON ({e}); republish the version") from e
    try:
        m = WeightsManifest.model_validate(raw)
    except ValidationError as e:
        raise ManifestError(
            f"{where} is invalid: {e.errors()[0]['msg']} ({e.error_count()} errors); republish the version"
        ) from e
    if version is not None and m.version != version:
        raise ManifestError(
            f"{where} says version {m.version}, but its folder is {version_name(version)}"
        )
    return m


def read_manifest(fs: fsspec.AbstractFileSystem, weights_dir: str, version: int) -> WeightsManifest:
    path = join(weights_dir, version_name(version), MANIFEST)
    return parse_manifest(read_bytes(fs, path), path, version)


def committed_versions(fs: fsspec.AbstractFileSystem, weights_dir: str) -> list[int]:
    """Versions whose manifest exists and parses. Folders without a manifest (torn, or
    a publish in progress) are skipped; a manifest that exists but does not parse is
    skipped with a warning, since that version was committed once and is now damaged."""
    found = {v: n for n in ls_names(fs, weights_dir) if (v := parse_version(n)) is not None}
    if not found:
        return []
    paths = {join(weights_dir, n, MANIFEST): v for v, n in found.items()}
    # One concurrent batch on S3 instead of a GET per version.
    blobs = fs.cat(list(paths), on_error="return")
    by_name = {k.rstrip("/").rsplit("/", 2)[-2]: b for k, b in blobs.items()}
    out = []
    for path, v in paths.items():
        data = by_name.get(version_name(v))
        if isinstance(data, bytes):
            try:
                parse_manifest(data, path, v)
            except ManifestError as e:
                log.warning(
                    "weights version %d is damaged and skipped: %s (version_state(%d) == 'damaged')",
                    v,
                    e,
                    v,
                )
                continue
            out.append(v)
    return sorted(out)
