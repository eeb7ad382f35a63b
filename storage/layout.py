"""Names inside a run folder: ``iter_000012``, ``v000012``, ``engine_000`` and the
validation of file names that come from manifests.

Owns naming only; must never touch a filesystem, so every other module agrees on
one spelling of each path.
"""

from __future__ import annotations

import re

from storage.errors import ManifestError, StorageError

RUN_JSON = "run.json"
LEASE_JSON = "lease.json"
# One claim object per lease acquisition, named by its fence (see storage.lease).
LEASE_FENCES = "lease-fences"
MANIFEST = "manifest.json"
COMMIT = "COMMIT"
METRICS_JSONL = "metrics.jsonl"
# An adapter version's files, as peft's save_pretrained names them.
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# Staging folders and files start with this; listings skip them.
TMP_PREFIX = ".tmp-"

_ITER_RE = re.compile(r"^iter_(\d{6,})$")
_VERSION_RE = re.compile(r"^v(\d{6,})$")
_ENGINE_RE = re.compile(r"^engine_(\d{3,})\.json$")
_STEP_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def iter_name(k: int) -> str:
    """``iter_000012`` for k=12."""
    _check_index(k, "iteration")
    return f"iter_{k:06d}"


def version_name(version: int) -> str:
    """``v000012`` for version 12."""
    _check_index(version, "version")
    return f"v{version:06d}"


def engine_name(engine_id: int) -> str:
    """``engine_000.json`` for engine 0."""
    _check_index(engine_id, "engine_id")
    return f"engine_{engine_id:03d}.json"


def fence_name(fence: int) -> str:
    """``000000000007.json`` for fence 7: zero-padded so listings sort by fence."""
    _check_index(fence, "fence")
    return f"{fence:012d}.json"


def parse_iter(name: str) -> int | None:
    """The k of ``iter_000012`` or ``iter_000012.json``; None for anything else."""
    m = _ITER_RE.match(name.removesuffix(".json"))
    return int(m.group(1)) if m else None


def parse_version(name: str) -> int | None:
    """The version of ``v000012``; None for anything else (staging dirs included)."""
    m = _VERSION_RE.match(name)
    return int(m.group(1)) if m else None


def parse_engine(name: str) -> int | None:
    """The engine id of ``engine_000.json``; None for anything else."""
    m = _ENGINE_RE.match(name)
    return int(m.group(1)) if m else None


def check_step(step: str) -> str:
    """Ledger step names become file names, so they must be plain words."""
    if not _STEP_RE.match(step):
        raise StorageError(
            f"ledger step name {step!r} is not a plain name; use letters, digits, '_', '-', '.'"
        )
    return step


def check_run_name(run_name: str) -> str:
    """Run names become one path component."""
    if not run_name or "/" in run_name or "\\" in run_name or run_name in (".", ".."):
        raise StorageError(
            f"run name {run_name!r} must be one non-empty path component without '/' or '..'"
        )
    return run_name


def check_file_name(name: str, reserved: tuple[str, ...] = ()) -> str:
    """A file name relative to a version/checkpoint folder that cannot escape it.

    Sub-folders (``a/b.bin``) are allowed; absolute names, ``..``, ``.``, empty
    parts, backslashes and NULs are not, because a pull writes these names on
    the reader's disk.
    """
    if not isinstance(name, str) or not name:
        raise ManifestError(f"file name {name!r} is empty; every file needs a relative name")
    bad = (
        name.startswith("/")
        or "\\" in name
        or "\x00" in name
        or re.match(r"^[A-Za-z]:", name) is not None
        or any(part in ("", ".", "..") for part in name.split("/"))
    )
    if bad:
        raise ManifestError(
            f"file name {name!r} is absolute or escapes its folder; use a plain relative name "
            "such as 'model-00001-of-00002.safetensors'"
        )
    if name in reserved or name.startswith(TMP_PREFIX):
        raise ManifestError(f"file name {name!r} is reserved by storage; rename the file")
    return name


def _check_index(i: int, what: str) -> None:
    if isinstance(i, bool) or not isinstance(i, int) or i < 0:
        raise StorageError(f"{what} must be an int >= 0, got {i!r}")
