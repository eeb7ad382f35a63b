"""The one way to open a storage root, plus the few primitive file operations
every store uses (atomic small writes, listings, recursive delete).

Owns: turning ``root`` strings into an fsspec filesystem, and "atomic" for
each backend (local: temp file + fsync + rename; S3: a single PUT). Must never
log, print or store credentials: S3 credentials come only from the standard
AWS environment variables, read by botocore itself.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from storage.config import S3Options
from storage.errors import StorageError
from storage.layout import TMP_PREFIX, parse_iter


def open_root(root: str, s3: S3Options | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return ``(fs, root_path)`` for a plain path, ``file://``, ``s3://bucket/prefix``
    or any other fsspec URL. ``root_path`` carries no credentials and no trailing '/'."""
    if not root:
        raise StorageError("storage.root is empty; set it to a path or an s3://bucket/prefix URL")
    proto, sep, rest = root.partition("://")
    if not sep or proto == "file":
        path = rest if sep else root
        return LocalFileSystem(), os.path.abspath(os.path.expanduser(path)).rstrip("/") or "/"
    netloc = rest.split("/", 1)[0]
    if "@" in netloc:
        # Refuse instead of silently dropping: a secret in a URL ends up in logs and run.json.
        raise StorageError(
            f"storage.root for protocol {proto!r} contains credentials; remove them from the URL "
            "and set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment instead"
        )
    if proto in ("s3", "s3a"):
        import s3fs  # only needed for s3:// roots

        opts = s3 or S3Options()
        client_kwargs: dict[str, Any] = {}
        if opts.region:
            client_kwargs["region_name"] = opts.region
        config_kwargs: dict[str, Any] = {}
        if opts.max_attempts is not None:
            config_kwargs["retries"] = {"max_attempts": opts.max_attempts, "mode": "standard"}
        fs = s3fs.S3FileSystem(
            anon=opts.anon,
            config_kwargs=config_kwargs,
            endpoint_url=opts.endpoint_url,
            client_kwargs=client_kwargs,
            # Other processes commit versions; a cached listing would hide them.
            use_listings_cache=False,
        )
        return fs, "s3://" + rest.strip("/")
    fs, _ = fsspec.url_to_fs(root)
    return fs, root.rstrip("/")


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True for local disk, where rename and fsync exist and are used."""
    return isinstance(fs, LocalFileSystem)


def join(*parts: str) -> str:
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts))


def fsync_dir(path: str) -> None:
    """Make a rename/creation inside ``path`` durable (POSIX needs the directory fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(
    fs: fsspec.AbstractFileSystem, path: str, data: bytes, exclusive: bool = False
) -> bool:
    """Write ``data`` so readers see the old object or the new one, never a torn one.

    With ``exclusive`` the write only happens if ``path`` does not exist yet;
    returns False when it already existed (and leaves it untouched).
    """
    if is_local(fs):
        return _write_local(path, data, exclusive)
    if not exclusive:
        fs.pipe_file(path, data)  # one PUT is atomic on S3; no parent "folder" to create
        return True
    if fs.exists(path):
        return False
    try:
        # If-None-Match: * closes the race between the check above and the PUT.
        fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        return False
    return True


def _write_local(path: str, data: bytes, exclusive: bool) -> bool:
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f"{TMP_PREFIX}{os.path.basename(path)}-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            try:
                os.link(tmp, path)  # fails if path exists: create-if-absent without a race
            except FileExistsError:
                return False
        else:
            os.replace(tmp, path)
        fsync_dir(parent)
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_bytes(fs: fsspec.AbstractFileSystem, path: str) -> bytes | None:
    """The object's bytes, or None when it does not exist."""
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        return None


def write_json(fs: fsspec.AbstractFileSystem, path: str, obj: Any, exclusive: bool = False) -> bool:
    return write_bytes(fs, path, dumps(obj), exclusive=exclusive)


def dumps(obj: Any) -> bytes:
    """Canonical JSON bytes (sorted keys) so identical records compare equal byte for byte."""
    return (json.dumps(obj, sort_keys=True, indent=1, allow_nan=False) + "\n").encode()


def read_json(fs: fsspec.AbstractFileSystem, path: str) -> Any | None:
    """Parsed JSON, or None when absent. Malformed JSON raises StorageError naming the path."""
    data = read_bytes(fs, path)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError as e:
        raise StorageError(f"{path} is not valid JSON ({e}); delete or restore it") from e


def ls_names(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """Base names directly under ``path`` ([] when it does not exist), staging names skipped."""
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    names = (e.rstrip("/").rsplit("/", 1)[-1] for e in entries)
    return sorted(n for n in names if n and not n.startswith(TMP_PREFIX))


def ls_all(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """Like ``ls_names`` but including staging names."""
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    return sorted(n for n in (e.rstrip("/").rsplit("/", 1)[-1] for e in entries) if n)


def rm_tree(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Delete a folder and everything under it; missing is fine."""
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


def rm_file(fs: fsspec.AbstractFileSystem, path: str) -> None:
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass


def parse_iter_dirs(names: list[str]) -> list[int]:
    """Sorted iterations of the ``iter_000012`` entries among ``names``."""
    return sorted(k for n in names if (k := parse_iter(n)) is not None)
