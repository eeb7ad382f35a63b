"""Trainer side of the in-memory weight transports (runs on train rank 0).

Owns cutting the full state into buckets of at most ``bucket_bytes``,
flattening each per dtype (``engines.flat_bucket``), and handing them to one
engine actor:
- ``tensor``: on CPU the bucket's flat tensors go into one /dev/shm file
  (64-byte aligned parts) that the engine maps; on GPU each flat tensor goes
  as a CUDA IPC handle (``torch.multiprocessing`` reductions, as SGLang and
  slime do). The producer keeps the file / tensor until the engine's call has
  returned (its ack), then frees it.
- ``distributed``: metadata by actor call, tensors by broadcast over a
  standalone process group {trainer rank 0, engine rank(s)}, one group per
  engine so each engine's reload is its own retriable task. A group whose
  engine has lost it (restarted) is torn down and rebuilt.
The weight version is set by the call carrying the last bucket. Never decides
which version to send and never gathers shards itself (the caller iterates
full tensors on every rank).
"""

from __future__ import annotations

import io
import os
import socket
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import ray
import torch

from engines import weight_receiver as wr
from engines.flat_bucket import FlatBucket, flatten, iter_buckets

ALIGN = 64
NamedTensors = Iterable[tuple[str, torch.Tensor]]


def _with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmSegment:
    """A /dev/shm file holding a bucket's flat tensors; unlinked by ``close``."""

    def __init__(self, buckets: list[FlatBucket]) -> None:
        offsets, off = [], 0
        for b in buckets:
            offsets.append(off)
            off += -(-b.flat.numel() * b.flat.element_size() // ALIGN) * ALIGN
        self.nbytes = max(off, ALIGN)
        self.path = os.path.join(_shm_dir(), f"prefect-rl-wb-{uuid.uuid4().hex}")
        with open(self.path, "wb") as f:
            f.truncate(self.nbytes)
        buf = torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)
        for b, o in zip(buckets, offsets):
            raw = b.flat.contiguous().view(torch.uint8)
            buf[o : o + raw.numel()].copy_(raw)
        del buf
        self.handle = {
            "kind": "shm",
            "path": self.path,
            "nbytes": self.nbytes,
            "parts": [{"offset": o, "metadata": b.metadata} for b, o in zip(buckets, offsets)],
        }

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _ipc_handle(buckets: list[FlatBucket]) -> dict[str, Any]:
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor reductions)

    parts = []
    for b in buckets:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(b.flat)
        parts.append({"handle": buf.getvalue(), "metadata": b.metadata})
    return {"kind": "cuda_ipc", "parts": parts}


def _check(reply: dict[str, Any], what: str) -> None:
    if not reply.get("success"):
        raise RuntimeError(f"engine refused {what}: {reply.get('message')}")


def send_tensor(
    engine: Any, named: NamedTensors, version: int, bucket_bytes: int, flush_cache: bool
) -> dict[str, Any]:
    """Hand every bucket to ``engine`` (same host); returns bytes and bucket count."""
    nbytes = nbuckets = 0
    for bucket, last in _with_last(iter_buckets(named, bucket_bytes)):
        flats = flatten(bucket)
        on_gpu = flats[0].flat.is_cuda
        segment = None if on_gpu else ShmSegment(flats)
        try:
            handle = _ipc_handle(flats) if on_gpu else segment.handle
            reply = ray.get(
                engine.update_weights_from_tensor.remote(
                    [handle],
                    flush_cache=flush_cache and last,
                    weight_version=str(version) if last else None,
                )
            )
        finally:  # the engine has copied (or failed): the producer's memory may go
            if segment is not None:
                segment.close()
            if on_gpu:
                torch.cuda.synchronize()
        _check(reply, f"bucket {nbuckets} of v{version}")
        nbytes += sum(b.flat.numel() * b.flat.element_size() for b in flats)
        nbuckets += 1
    return {"bytes": nbytes, "buckets": nbuckets}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class BroadcastSender:
    """Trainer rank 0's broadcast groups, one per engine, by group name."""

    def __init__(self) -> None:
        self.groups: dict[str, Any] = {}

    def ensure_group(self, engine: Any, group_name: str, backend: str) -> Any:
        pg = self.groups.get(group_name)
        if pg is not None and ray.get(engine.has_weights_update_group.remote(group_name)):
            return pg
        if pg is not None:  # the engine was restarted: its end of the group is gone
            wr.destroy_group(self.groups.pop(group_name))
        addr, port = ray.util.get_node_ip_address(), _free_port()
        joined = engine.init_weights_update_group.remote(addr, port, 1, 2, group_name, backend)
        pg = wr.make_group(addr, port, 0, 2, group_name, backend)
        _check(ray.get(joined), f"init_weights_update_group({group_name})")
        self.groups[group_name] = pg
        return pg

    def send(
        self,
        engine: Any,
        named: NamedTensors,
        version: int,
        bucket_bytes: int,
        flush_cache: bool,
        group_name: str,
        backend: str,
    ) -> dict[str, Any]:
        pg = self.ensure_group(engine, group_name, backend)
        nbytes = nbuckets = 0
        for bucket, last in _with_last(iter_buckets(named, bucket_bytes)):
            flats = flatten(bucket)
            metas = [m for b in flats for m in b.metadata]
            reply_ref = engine.update_weights_from_distributed.remote(
                [m.name for m in metas],
                [m.dtype for m in metas],
                [list(m.shape) for m in metas],
                group_name=group_name,
                flush_cache=flush_cache and last,
                weight_version=str(version) if last else None,
            )
            for b in flats:
                wr.broadcast(pg, b.flat.contiguous())
            _check(ray.get(reply_ref), f"bucket {nbuckets} of v{version}")
            nbytes += sum(b.flat.numel() * b.flat.element_size() for b in flats)
            nbuckets += 1
        return {"bytes": nbytes, "buckets": nbuckets}

    def close(self) -> None:
        for pg in self.groups.values():
            wr.destroy_group(pg)
        self.groups.clear()
