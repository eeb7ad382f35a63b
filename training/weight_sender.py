"""Trainer side of the in-memory weight transports (runs on train rank 0).

Owns cutting the full state into buckets of at most ``bucket_bytes``,
flattening each per dtype (``engines.flat_bucket``), and handing them to one
engine actor:
- ``tensor``: on CPU the bucket's flat tensors go into one /dev/shm file
  (64-byte aligned parts) that the engine maps; on GPU each flat tensor goes
  as a CUDA IPC handle (``torch.multiprocessing`` reductions, as SGLang and
  slime do). An engine spanning several ranks gets one handle per rank (rank
  j loads handle j): train rank ``j % world`` makes engine rank j's handle on
  its own device (colocated: the same GPU), and the handles are gathered to
  train rank 0 over gloo (slime's ``UpdateWeightFromTensor``), which calls
  the engine. The producers keep their file / tensor until rank 0 has the
  engine's reply (its ack), then free it.
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
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import ray
import torch
import torch.distributed as dist

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


def engine_ranks(engine: Any) -> int:
    """How many ranks (tensor-parallel size) the engine actor spans."""
    return int(ray.get(engine.model_info.remote()).get("tp_size", 1))


class HandleGather:
    """The train ranks' side of one tensor push: who makes a handle, and the
    gloo collectives that bring the handles to rank 0 and its ack back."""

    def __init__(self, rank: int, world: int, engine_ranks: int, group: Any = None) -> None:
        self.rank, self.world, self.engine_ranks = rank, world, engine_ranks
        self.group = group  # a gloo group over all train ranks; None with one rank

    @property
    def producer(self) -> bool:
        """This rank makes the handle of engine rank(s) j with j % world == rank."""
        return self.rank < min(self.world, self.engine_ranks)

    def to_rank0(self, handle: dict[str, Any] | None) -> list[dict[str, Any]] | None:
        """On rank 0: one handle per engine rank; elsewhere None."""
        if self.world == 1:
            by_train_rank = [handle]
        else:
            by_train_rank = [None] * self.world if self.rank == 0 else None
            dist.gather_object(handle, by_train_rank, dst=0, group=self.group)
            if self.rank != 0:
                return None
        return [by_train_rank[j % self.world] for j in range(self.engine_ranks)]

    def ack(self, error: str | None) -> str | None:
        """Rank 0's outcome of the engine call, on every rank."""
        if self.world == 1:
            return error
        box = [error]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def send_tensor(
    engine: Any,
    named: NamedTensors,
    version: int,
    bucket_bytes: int,
    flush_cache: bool,
    gather: HandleGather,
) -> dict[str, Any] | None:
    """Hand every bucket to ``engine`` (same host). Collective over the train ranks
    (each iterates the same full tensors); rank 0 returns bytes and bucket count."""
    nbytes = nbuckets = 0
    for bucket, last in _with_last(iter_buckets(named, bucket_bytes)):
        flats = flatten(bucket)
        on_gpu = flats[0].flat.is_cuda
        segment = None if on_gpu or not gather.producer else ShmSegment(flats)
        error = None
        try:
            mine = None
            if gather.producer:
                mine = _ipc_handle(flats) if on_gpu else segment.handle
            handles = gather.to_rank0(mine)
            if handles is not None:
                try:
                    reply = ray.get(
                        engine.update_weights_from_tensor.remote(
                            handles,
                            flush_cache=flush_cache and last,
                            weight_version=str(version) if last else None,
                        )
                    )
                    _check(reply, f"bucket {nbuckets} of v{version}")
                except Exception as e:  # every rank must hear of it, or they would wait
                    error = f"{type(e).__name__}: {e}"
            error = gather.ack(error)
        finally:  # the engine has copied (or failed): the producer's memory may go
            if segment is not None:
                segment.close()
            if on_gpu:
                torch.cuda.synchronize()
        if error is not None:
            raise RuntimeError(error)
        nbytes += sum(b.flat.numel() * b.flat.element_size() for b in flats)
        nbuckets += 1
    return {"bytes": nbytes, "buckets": nbuckets} if gather.rank == 0 else None


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
        addr, port = ray.util.get_node_ip_address(), wr.free_port()
        world = 1 + engine_ranks(engine)  # trainer rank 0 plus every engine rank
        joined = engine.init_weights_update_group.remote(addr, port, 1, world, group_name, backend)
        pg = wr.make_group(addr, port, 0, world, group_name, backend)
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
