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

from storage.config import S3Options, StorageConfig
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
    check_no_credentials(root)
    if proto in ("s3", "s3a"):
        import s3fs  # only needed for s3:// roots

        # Other processes commit versions; a cached listing would hide them.
        opts = s3 or S3Options()
        fs = s3fs.S3FileSystem(**s3_settings(opts), use_listings_cache=False)
        if opts.max_attempts is not None:
            # s3fs tries a request 5 times around botocore's own attempts (timeouts,
            # dropped connections): a user's max_attempts would be multiplied by 5.
            fs.retries = 1
        return fs, "s3://" + rest.strip("/")
    fs, _ = fsspec.url_to_fs(root)
    return fs, root.rstrip("/")


def s3_settings(opts: S3Options) -> dict[str, Any]:
    """``s3fs.S3FileSystem``'s keyword arguments for ``opts``: every S3 client of a run
    (its store, and Prefect's result storage beside it) gets the same endpoint, region,
    timeouts and attempts. Plain JSON, which Prefect's storage block keeps."""
    client_kwargs: dict[str, Any] = {}
    if opts.region:
        client_kwargs["region_name"] = opts.region
    config_kwargs: dict[str, Any] = {
        "connect_timeout": opts.connect_timeout_s,
        "read_timeout": opts.read_timeout_s,
    }
    if opts.max_attempts is not None:
        config_kwargs["retries"] = {"max_attempts": opts.max_attempts, "mode": "standard"}
    return {
        "anon": opts.anon,
        "config_kwargs": config_kwargs,
        "endpoint_url": opts.endpoint_url,
        "client_kwargs": client_kwargs,
    }


def redact(root: str) -> str:
    """``root`` with any ``user:secret@`` part replaced, safe to show in messages."""
    proto, sep, rest = root.partition("://")
    netloc, slash, path = rest.partition("/")
    if not sep or "@" not in netloc:
        return root
    return f"{proto}://***@{netloc.rsplit('@', 1)[1]}{slash}{path}"


def check_no_credentials(root: str) -> None:
    """Refuse a URL carrying ``key:secret@``: it would end up in logs and run.json. The
    message shows the URL with the credentials cut out, never the secret."""
    proto, sep, rest = root.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        raise StorageError(
            f"storage.root {redact(root)} contains credentials; remove them from the URL and "
            "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment instead"
        )


def check_root(cfg: StorageConfig) -> None:
    """Fail early, before any flow run or file exists, with a message naming the root
    and the fix: credentials in the URL, a root that is a file, a root (or its nearest
    existing parent) that is not writable, a missing or inaccessible S3 bucket. Leaves
    nothing behind (the probe object/file is removed)."""
    if not cfg.root:
        raise StorageError("storage.root is empty; set it to a path or an s3://bucket/prefix URL")
    check_no_credentials(cfg.root)
    fs, root = open_root(cfg.root, cfg.s3)
    if is_local(fs):
        check_local_folder(root)
    elif root.startswith("s3://"):
        _check_s3_root(fs, root, cfg.s3)


def check_local_folder(root: str, key: str = "storage.root") -> None:
    """Refuse a local folder setting ``key`` that a run could not write in: the
    path (or its nearest existing parent) is a file or not writable. The probe
    file is removed; nothing is created."""
    probe_dir = root = os.path.abspath(root)  # a relative path's dirname ends at "", not "/"
    while not os.path.exists(probe_dir):  # the nearest existing parent is where mkdir happens
        probe_dir = os.path.dirname(probe_dir)
    if not os.path.isdir(probe_dir):
        where = key if probe_dir == root else f"its parent {probe_dir}"
        raise StorageError(
            f"{key} {root}: {where} is a file, not a folder; "
            f"set {key} to a folder (or move that file away)"
        )
    fix = f"set {key} to a writable folder, or fix the folder's permissions/mount"
    if not os.access(probe_dir, os.W_OK | os.X_OK):
        raise StorageError(f"{key} {root}: {probe_dir} is not writable; {fix}")
    probe = os.path.join(probe_dir, f"{TMP_PREFIX}check-{uuid.uuid4().hex}")
    try:
        with open(probe, "wb") as f:  # os.access misses read-only mounts seen by root, quotas
            f.write(b"probe")
    except OSError as e:
        raise StorageError(f"{key} {root}: cannot write in {probe_dir} ({e}); {fix}") from e
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


def _check_s3_root(fs: fsspec.AbstractFileSystem, root: str, s3: S3Options) -> None:
    bucket = root.removeprefix("s3://").split("/", 1)[0]
    endpoint = s3.endpoint_url or "the AWS default endpoint"
    creds = "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the profile) and the bucket policy"
    try:
        fs.call_s3("head_bucket", Bucket=bucket)
    except FileNotFoundError:
        raise StorageError(
            f"storage.root {root}: bucket {bucket!r} does not exist at {endpoint}; create it "
            f"(aws s3 mb s3://{bucket}) or fix the bucket name / storage.s3.endpoint_url"
        ) from None
    except PermissionError:
        raise StorageError(
            f"storage.root {root}: access to bucket {bucket!r} at {endpoint} is denied; {creds}"
        ) from None
    except Exception as e:  # unreachable endpoint, DNS, TLS, no credentials: many kinds
        fix = (
            creds
            if "Credentials" in type(e).__name__
            else "check storage.s3.endpoint_url and the network"
        )
        if "Timeout" in type(e).__name__:  # it answered nothing within the configured limit
            fix += " (requests time out after storage.s3.connect_timeout_s / read_timeout_s)"
        raise StorageError(
            f"storage.root {root}: cannot reach bucket {bucket!r} at {endpoint} ({type(e).__name__}); {fix}"
        ) from None
    probe = join(root, f"{TMP_PREFIX}check-{uuid.uuid4().hex}")
    try:
        fs.pipe_file(probe, b"probe")
        fs.rm_file(probe)
    except Exception as e:
        raise StorageError(
            f"storage.root {root}: cannot write to bucket {bucket!r} at {endpoint} "
            f"({type(e).__name__}); check the credentials' permissions and the bucket policy"
        ) from None


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
