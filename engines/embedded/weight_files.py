"""Reading an HF safetensors directory for a weight load: confined and verified.

Owns which files a load opens and what it trusts in them:
- the shards are those named by ``model.safetensors.index.json`` (plain file
  names inside the directory, ``engines.weights.shard_names``) or the single
  ``model.safetensors``;
- with ``roots`` (reloads asked for over HTTP) every file is resolved after
  it is opened (symlinks, ``..``) and must lie under an allowed root, else
  WeightPathError;
- when the directory holds ``manifest.json`` (``storage`` writes it last into
  every version folder and every pulled cache folder), every file it lists
  must match its size and hashes (its tree's chunk hashes on every core,
  ``storage.tree``; the sha256 for an entry written before trees): each shard
  is mapped, hashed over the mapping and then copied into the model from the
  same pages (so one read from disk), the small rest (config, tokenizer)
  hashed on its own; a mismatch (naming the chunk) or a shard missing from
  the manifest is WeightIntegrityError and nothing is loaded. A directory
  without a manifest (a plain HF dir, e.g. the base model) loads unverified,
  as HF would load it;
- the safetensors layout (8-byte header length, JSON header, raw bytes) is
  parsed here with every offset checked, so a truncated or garbled shard is a
  WeightLoadError naming the file, never a crash inside a reader library.
Never writes, never builds a model, never touches a file outside ``model_dir``
except through a symlink the roots allow.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from engines.security import confine
from engines.weights import INDEX_NAME, SINGLE_NAME, shard_names
from storage import tree
from storage.errors import ManifestError
from storage.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST
from storage.manifests import parse_manifest
from storage.types import FileEntry, WeightsManifest
from wire.errors import WeightIntegrityError, WeightLoadError, WeightPathError

READ_CHUNK = 8 << 20  # bytes per read when hashing the small files
FIX = "republish or re-pull the version"

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class _Dir:
    """One directory being read: its real path, the roots and the manifest's entries."""

    def __init__(self, model_dir: str, roots: tuple[str, ...] | None) -> None:
        try:
            self.root = confine(model_dir, roots, "model_path")
        except PermissionError as e:
            raise WeightPathError(str(e)) from None
        if not os.path.isdir(self.root):
            raise WeightLoadError(f"{model_dir} is not a directory")
        self.roots = roots
        self.entries: dict[str, FileEntry] | None = None
        self.manifest: WeightsManifest | None = None
        if os.path.lexists(os.path.join(self.root, MANIFEST)):
            data = bytes(self.read(MANIFEST, verify=False))
            where = os.path.join(model_dir, MANIFEST)
            try:
                self.manifest = parse_manifest(data, where)
            except ManifestError as e:
                raise WeightIntegrityError(f"{e}; {FIX}") from None
            if self.manifest.delta is not None:  # XOR files: only a pull rebuilds weights
                raise WeightIntegrityError(
                    f"{where} is a delta of v{self.manifest.delta.base}; load the version "
                    "through a pull into the engines' cache, which rebuilds and verifies it"
                )
            self.entries = {f.name: f for f in self.manifest.files}

    def open(self, name: str) -> tuple[Any, int]:
        """The open file ``name`` (confined after it is opened) and its size."""
        path = os.path.join(self.root, name)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            raise WeightLoadError(f"{name} is missing from {self.root}") from None
        try:
            real = os.readlink(f"/proc/self/fd/{f.fileno()}")
        except OSError:  # no procfs: the path as it resolves now
            real = path
        try:
            confine(real, self.roots, "file")
        except PermissionError as e:
            f.close()
            raise WeightPathError(f"{name} in {self.root}: {e}") from None
        return f, os.fstat(f.fileno()).st_size

    def entry(self, name: str) -> FileEntry | None:
        if self.entries is None:
            return None
        if name not in self.entries:
            raise WeightIntegrityError(
                f"{name} is in {self.root} but not in its manifest.json; {FIX}"
            )
        return self.entries[name]

    def read(self, name: str, verify: bool = True) -> torch.Tensor:
        """All bytes of ``name`` as a uint8 tensor over a private mapping of the file
        (page-cache pages, no copy), checked against the manifest: the sha256 runs
        over the mapped bytes, which the load then copies into the model."""
        entry = self.entry(name) if verify else None
        f, size = self.open(name)
        with f:
            _check_size(name, size, entry)
            if size == 0:
                return torch.empty(0, dtype=torch.uint8)
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        if entry is not None and entry.tree is not None:
            _check_tree(
                name, tree.problem(entry, tree.buffer_digests(memoryview(mm), entry.tree.chunk))
            )
        elif entry is not None:
            _check_sha(name, hashlib.sha256(mm).hexdigest(), entry)
        return torch.frombuffer(mm, dtype=torch.uint8)  # keeps the mapping alive

    def verify_rest(self, done: set[str]) -> None:
        """Size and hashes of every manifest file not read (and so not checked) yet."""
        for name, entry in sorted((self.entries or {}).items()):
            if name in done:
                continue
            f, size = self.open(name)
            with f:
                _check_size(name, size, entry)
                if entry.tree is not None:
                    _check_tree(name, tree.check_fd(f.fileno(), size, entry))
                    continue
                buf = bytearray(min(size, READ_CHUNK))
                sha = hashlib.sha256()
                while n := f.readinto(buf):
                    sha.update(memoryview(buf)[:n])
            _check_sha(name, sha.hexdigest(), entry)


def _check_size(name: str, size: int, entry: FileEntry | None) -> None:
    if entry is not None and size != entry.bytes:
        raise WeightIntegrityError(
            f"size mismatch in {name}: {size} bytes, manifest.json says {entry.bytes} "
            f"(truncated or corrupt); {FIX}"
        )


def _check_tree(name: str, problem: str | None) -> None:
    if problem is not None:
        raise WeightIntegrityError(f"hash mismatch in {name}: {problem}; {FIX}")


def _check_sha(name: str, sha: str | None, entry: FileEntry | None) -> None:
    if entry is not None and sha != entry.sha256:
        raise WeightIntegrityError(
            f"sha256 mismatch in {name}: {sha}, manifest.json says {entry.sha256}; {FIX}"
        )


def parse_safetensors(buf: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file held in ``buf`` (uint8), as views where aligned."""
    size = buf.numel()

    def bad(why: str) -> WeightLoadError:
        return WeightLoadError(f"cannot read {name}: {why} (truncated or not safetensors)")

    if size < 8:
        raise bad(f"{size} bytes is too short for a header")
    header_len = int.from_bytes(bytes(buf[:8].numpy()), "little")
    start = 8 + header_len
    if start > size:
        raise bad(f"header of {header_len} bytes runs past the end of the {size}-byte file")
    try:
        header = json.loads(bytes(buf[8:start].numpy()))
        assert isinstance(header, dict)
    except (ValueError, AssertionError):
        raise bad("header is not a JSON object") from None
    out: dict[str, torch.Tensor] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            lo, hi = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {key!r} has a malformed header entry") from None
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(shape) * itemsize
        if min(shape, default=0) < 0 or hi - lo != nbytes or lo < 0 or start + hi > size:
            raise bad(f"tensor {key!r} (bytes {lo}..{hi}) does not fit the file")
        raw = buf[start + lo : start + hi]
        if (start + lo) % itemsize:
            raw = raw.clone()  # a view of another dtype needs an aligned offset
        out[key] = raw.view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)
    return out


def read_state_dict(
    model_dir: str, roots: tuple[str, ...] | None = None
) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors dir, on CPU, confined to ``roots`` (None: any
    path) and verified against its manifest.json when it has one."""
    d = _Dir(str(model_dir), roots)
    if d.manifest is not None and d.manifest.adapter is not None:
        raise WeightLoadError(
            f"{model_dir} holds version {d.manifest.version}, a LoRA adapter of "
            f"v{d.manifest.adapter.base}: load it with load_lora_adapter"
        )
    read: set[str] = set()
    if os.path.lexists(os.path.join(d.root, INDEX_NAME)):
        names = shard_names(bytes(d.read(INDEX_NAME).numpy()), INDEX_NAME)
        read.add(INDEX_NAME)
    elif os.path.lexists(os.path.join(d.root, SINGLE_NAME)):
        names = [SINGLE_NAME]
    else:
        raise WeightLoadError(f"{model_dir} has neither {INDEX_NAME} nor {SINGLE_NAME}")
    state: dict[str, torch.Tensor] = {}
    # Shards are hashed in parallel (hashlib releases the GIL on big buffers).
    with ThreadPoolExecutor(max(1, min(len(names), os.cpu_count() or 1, 8))) as pool:
        for name, buf in zip(names, pool.map(d.read, names)):
            state.update(parse_safetensors(buf, name))
            read.add(name)
    d.verify_rest(read)
    return state


def read_adapter(
    adapter_dir: str, roots: tuple[str, ...] | None = None
) -> tuple[WeightsManifest | None, dict[str, Any], dict[str, torch.Tensor]]:
    """(manifest, peft config, tensors in peft's names) of a peft adapter folder, on CPU,
    confined to ``roots`` and verified against its manifest.json when it has one (which
    must then be an adapter version's)."""
    d = _Dir(str(adapter_dir), roots)
    if d.manifest is not None and d.manifest.adapter is None:
        raise WeightLoadError(
            f"{adapter_dir} holds version {d.manifest.version} as full weights, not an "
            "adapter: load it with update_weights_from_disk"
        )
    try:
        config = json.loads(bytes(d.read(ADAPTER_CONFIG).numpy()))
        assert isinstance(config, dict)
    except (ValueError, AssertionError):
        raise WeightLoadError(f"{ADAPTER_CONFIG} in {adapter_dir} is not a JSON object") from None
    tensors = parse_safetensors(d.read(ADAPTER_WEIGHTS), ADAPTER_WEIGHTS)
    d.verify_rest({ADAPTER_CONFIG, ADAPTER_WEIGHTS})
    return d.manifest, config, tensors


def read_manifest(model_dir: str) -> WeightsManifest | None:
    """The manifest.json of ``model_dir``, parsed (not checked against the files: for a
    folder a load has just verified); None when it has none."""
    return _Dir(str(model_dir), None).manifest


def verify_dir(model_dir: str) -> WeightsManifest | None:
    """Check every file of ``model_dir`` against its manifest.json (None: it has none).

    For engine starts, where HF's loader reads the files itself afterwards.
    """
    d = _Dir(str(model_dir), None)
    d.verify_rest(set())
    return d.manifest
