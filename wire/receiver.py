"""Engine side of the in-memory weight transports.

Owns turning what a trainer hands over into tensors copied into the model:
- ``tensor`` buckets: shared-memory segments (CPU; a /dev/shm file the
  producer keeps until the engine's call returns) or CUDA IPC handles (GPU),
  each holding one flat tensor per dtype in the ``flattened_bucket`` layout.
  Handles are checked before use (``check_handle``): only the allow-listed
  unpickler reads their bytes (``wire.safe_pickle``), and a shared-memory
  handle may only name a producer segment in the shared-memory folder.
  A handle may carry ``cache`` (``engines.embedded.weight_cache``): the producer keeps
  that buffer across updates and the receiver keeps it open;
- ``distributed`` buckets: flat tensors received by broadcast from trainer
  rank 0 over a process group of its own (gloo on CPU, NCCL on GPU), built
  from an explicit TCPStore so it never touches a default process group.
Never decides versions, never frees the producer's memory and never calls
``pickle.loads`` on bytes from a request.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from wire.errors import WeightLoadError
from wire.flat_bucket import FlatBucket, TensorMeta, flat_from_meta, to_dtype, unflatten
from wire.safe_pickle import UnsafePickleError, safe_loads

GROUP_TIMEOUT = timedelta(minutes=10)
# training.weight_sender.ShmSegment names its files so; nothing else may be mapped.
SHM_PREFIX = "prefect-rl-wb-"


def encode_handle(handle: dict[str, Any]) -> str:
    """A bucket handle as the base64 string SGLang's HTTP API carries."""
    import base64

    return base64.b64encode(pickle.dumps(handle)).decode()


def decode_handle(text: str) -> dict[str, Any]:
    """Inverse of ``encode_handle``, through the allow-list unpickler; a checked handle.
    UnsafePickleError (a ValueError) for anything that is not a bucket handle."""
    import base64
    import binascii

    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise UnsafePickleError(f"handle is not base64: {e}") from None
    return check_handle(safe_loads(raw, "handle"))


def shm_dirs() -> tuple[str, ...]:
    """Where producers put shared-memory segments (``training.weight_staging.shm_dir``)."""
    return tuple({os.path.realpath(d) for d in ("/dev/shm", tempfile.gettempdir())})


def _fail(msg: str) -> None:
    raise UnsafePickleError(f"bad bucket handle: {msg}")


def check_handle(handle: Any) -> dict[str, Any]:
    """``handle`` if it has the shape ``training.weight_sender`` makes, else UnsafePickleError.

    A shared-memory handle must name a producer segment (``SHM_PREFIX``) in a
    shared-memory folder, so a handle cannot map an arbitrary file into the weights.
    """
    if not isinstance(handle, dict) or handle.get("kind") not in ("shm", "cuda_ipc"):
        _fail("expected a dict with kind 'shm' or 'cuda_ipc'")
    parts = handle.get("parts")
    if not isinstance(parts, list):
        _fail("'parts' must be a list")
    cache = handle.get("cache")
    if cache is not None and not (
        isinstance(cache, dict)
        and isinstance(cache.get("channel"), str)
        and isinstance(cache.get("key"), str)
        and isinstance(cache.get("keep", False), bool)
    ):
        _fail("'cache' must be {'channel': str, 'key': str, 'keep': bool}")
    for part in parts:
        if not isinstance(part, dict):
            _fail("every part must be a dict")
        meta = part.get("metadata")
        # A cached handle may leave the metadata out: the receiver opened it before.
        if meta is not None or cache is None:
            if not isinstance(meta, list) or not meta:
                _fail("every part needs a non-empty 'metadata' list")
            if not all(isinstance(m, TensorMeta) for m in meta):
                _fail("metadata entries must be TensorMeta")
        key, kind = ("offset", int) if handle["kind"] == "shm" else ("handle", bytes)
        if not isinstance(part.get(key), kind):
            _fail(f"every {handle['kind']} part needs {key!r} ({kind.__name__})")
    if handle["kind"] == "shm":
        path, nbytes = handle.get("path"), handle.get("nbytes")
        if not isinstance(path, str) or not isinstance(nbytes, int) or nbytes <= 0:
            _fail("a shm handle needs 'path' (str) and 'nbytes' (int > 0)")
        real = os.path.realpath(path)
        if os.path.dirname(real) not in shm_dirs() or not os.path.basename(real).startswith(
            SHM_PREFIX
        ):
            _fail(f"shm path {path!r} is not a producer segment ({SHM_PREFIX}* in {shm_dirs()})")
    return handle


def open_bucket(handle: dict[str, Any], device: torch.device) -> list[FlatBucket]:
    """The FlatBuckets of one transfer handle, as views of the producer's memory."""
    kind = check_handle(handle)["kind"]
    if kind == "shm":
        buf = torch.from_file(handle["path"], shared=True, size=handle["nbytes"], dtype=torch.uint8)
        out = []
        for part in handle["parts"]:
            dtype = to_dtype(part["metadata"][0].dtype)
            nbytes = flat_from_meta(part["metadata"]) * torch.empty((), dtype=dtype).element_size()
            if part["offset"] < 0 or part["offset"] + nbytes > handle["nbytes"]:
                raise WeightLoadError(
                    f"bucket part at {part['offset']} (+{nbytes} bytes) overruns the "
                    f"{handle['nbytes']}-byte segment {handle['path']}"
                )
            flat = buf[part["offset"] : part["offset"] + nbytes].view(dtype)
            out.append(FlatBucket(flat=flat, metadata=part["metadata"]))
        return out
    if kind == "cuda_ipc":
        out = []
        for part in handle["parts"]:
            flat, meta = _cuda_tensor(part["handle"]), part["metadata"]
            if (
                flat.dim() != 1
                or flat.numel() < flat_from_meta(meta)
                or (flat.dtype != to_dtype(meta[0].dtype))
            ):
                raise WeightLoadError(
                    f"CUDA IPC part {flat.dtype} [{flat.numel()}] does not hold its metadata "
                    f"({meta[0].dtype}, {flat_from_meta(meta)} elements)"
                )
            out.append(FlatBucket(flat=flat, metadata=meta))
        return out
    raise ValueError(f"unknown bucket handle kind {kind!r}: expected 'shm' or 'cuda_ipc'")


def _cuda_tensor(data: bytes) -> torch.Tensor:
    """The producer's CUDA tensor behind a ForkingPickler dump, opened by IPC."""
    import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor reductions)

    t = safe_loads(data, "CUDA IPC handle")
    if not isinstance(t, torch.Tensor):
        raise UnsafePickleError(f"CUDA IPC handle holds a {type(t).__name__}, not a tensor")
    return t


@torch.no_grad()
def copy_into(model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> int:
    """Copy named tensors into the model's state (casting dtype/device); returns bytes copied.

    Every name and shape is checked before the first copy, so a bad bucket
    leaves the model untouched.
    """
    state = model.state_dict()
    bad = [n for n, t in named if n not in state or state[n].shape != t.shape]
    if bad:
        raise WeightLoadError(f"bucket does not fit the model: {bad[:5]} ({len(bad)})")
    total = 0
    for name, t in named:
        state[name].copy_(t)
        total += t.numel() * t.element_size()
    return total


def metadata_of(
    names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> list[list[TensorMeta]]:
    """Per-dtype metadata (first-seen dtype order) of a distributed bucket, exactly as
    ``flat_bucket.flatten`` lays it out on the sender."""
    groups: dict[str, list[TensorMeta]] = {}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        metas = groups.setdefault(dtype, [])
        start = metas[-1].end if metas else 0
        numel = 1
        for d in shape:
            numel *= int(d)
        metas.append(
            TensorMeta(name, tuple(int(d) for d in shape), dtype, start, start + numel, numel)
        )
    return list(groups.values())


def free_port() -> int:
    """A free TCP port on this host, for a group's TCPStore."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def make_group(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str
) -> Any:
    """A standalone process group (not registered as the default one): trainer rank 0
    is rank 0 and hosts the TCPStore."""
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=GROUP_TIMEOUT
    )
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, GROUP_TIMEOUT)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = GROUP_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"backend {backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")


def broadcast(pg: Any, tensor: torch.Tensor, root: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    pg.broadcast([tensor], opts).wait()


def receive_bucket(
    pg: Any, metas: list[list[TensorMeta]], device: torch.device
) -> list[FlatBucket]:
    """Receive one flat tensor per dtype from rank 0, in metadata order."""
    out = []
    for metadata in metas:
        flat = torch.empty(
            flat_from_meta(metadata), dtype=to_dtype(metadata[0].dtype), device=device
        )
        broadcast(pg, flat)
        out.append(FlatBucket(flat=flat, metadata=metadata))
    return out


def named_tensors(buckets: list[FlatBucket]) -> list[tuple[str, torch.Tensor]]:
    return [item for b in buckets for item in unflatten(b)]


def destroy_group(pg: Any) -> None:
    """Best effort: NCCL groups hold communicators until shut down; gloo ones just go."""
    for method in ("shutdown", "abort"):
        fn = getattr(pg, method, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception:  # an already broken group is being dropped anyway
                pass


def all_reduce(pg: Any, tensor: torch.Tensor) -> None:
    """Sum ``tensor`` in place over ``pg`` (the engine's tensor-parallel group)."""
    pg.allreduce([tensor]).wait()
