"""Trainer side of the ``tensor`` weight transport (runs on every train rank).

Owns handing the full state to one engine actor on the same host:
- resident (``TensorPusher`` with a trainer that never sleeps): one staging
  buffer for the whole model (``training.weight_staging``), one flat tensor
  per dtype, registered once (a CUDA IPC handle on GPU, a shared-memory
  segment on CPU) and refilled at each update; one signal per update, which
  the engine answers from its cache of opened handles
  (``engines.embedded.weight_cache``). The signal is a line on the engine's Unix socket
  (``wire.update_socket``) when a single-rank engine offers one, else a Ray
  call; the first update to an engine goes over Ray in full. The layout is
  learnt from the first push, which streams. An engine that does not hold the
  key (restarted) answers ``cache_miss`` and gets the handle again in full.
- streamed (colocated ranks, which sleep between pushes and so keep no second
  copy of the model, and every push into SGLang): buckets of at most
  ``bucket_bytes``, flattened per dtype (``wire.flat_bucket``), one handle and
  one call per bucket; the producer frees each bucket after the engine's reply.
  An engine spanning several ranks gets one handle per rank (rank j loads
  handle j): train rank ``j % world`` makes engine rank j's handle on its own
  device, and the handles are gathered to train rank 0 over gloo (slime's
  ``UpdateWeightFromTensor``), which calls the engine and broadcasts the outcome.
The weight version is set by the call carrying the last bucket. A LoRA adapter
(``send_adapter``) goes whole, as one bucket, to the engine's
``load_lora_adapter_from_tensors`` under the name ``v{k}`` (``wire.lora``). Which transport
a push takes, and the gloo group, are ``training.weight_pusher``'s; the
``distributed`` transport is ``training.broadcast_sender``. Never decides which
version to send and never gathers shards itself (the caller iterates full
tensors on every rank).
"""

from __future__ import annotations

import io
import logging
import os
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import ray
import torch
import torch.distributed as dist

from training.update_signal import EngineSignals
from training.weight_staging import Layout, Staging, has_room, segment_path
from wire.flat_bucket import FlatBucket, flatten, iter_buckets

ALIGN = 64
log = logging.getLogger(__name__)
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


class ShmSegment:
    """A /dev/shm file holding a bucket's flat tensors; unlinked by ``close``."""

    def __init__(self, buckets: list[FlatBucket]) -> None:
        offsets, off = [], 0
        for b in buckets:
            offsets.append(off)
            off += -(-b.flat.numel() * b.flat.element_size() // ALIGN) * ALIGN
        self.nbytes = max(off, ALIGN)
        self.path = segment_path()
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


def _sglang_payload(flats: list[FlatBucket], on_gpu: bool) -> str:
    if not on_gpu:
        raise RuntimeError(
            "an SGLang engine takes weights.transport 'tensor' as CUDA IPC handles, but the "
            "trainer's weights are on the CPU: train on the GPU (train.num_gpus_per_worker > 0) "
            "or use weights.transport: disk"
        )
    from wire.sglang_payload import tensor_payload

    return tensor_payload(flats)


def _check(reply: dict[str, Any], what: str) -> None:
    if not reply.get("success"):
        raise RuntimeError(f"engine refused {what}: {reply.get('message')}")


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


def engine_key(engine: Any) -> str:
    """A stable id of an engine actor (its Ray actor id): a restarted engine is a new one."""
    actor_id = getattr(engine, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else str(id(engine))


class TensorPusher:
    """One train rank's side of ``tensor`` pushes, kept across updates; see the module
    docstring. ``resident=False`` drops the staging buffer and streams."""

    def __init__(self, device: torch.device) -> None:
        self.device = device  # where the staging buffer lives: the rank's own device
        self.channel = uuid.uuid4().hex  # this rank, as engines' caches know it
        self.layout: Layout | None = None
        self.staging: Staging | None = None
        self._bind = False  # the staging buffer holds the model's own tensors
        self._no_room = False  # the device (or /dev/shm) cannot hold a staging buffer
        self._ranks: dict[str, tuple[int, str]] = {}  # engine key -> (TP size, wire format)
        self._signals = EngineSignals()  # how each engine takes a cached update

    def engine_profile(self, engine: Any) -> tuple[int, str]:
        """How many ranks (tensor-parallel size) the engine actor spans, and the payload
        format it reads ("embedded", or "sglang": ``wire.sglang_payload``); asked once."""
        key = engine_key(engine)
        if key not in self._ranks:
            info = ray.get(engine.model_info.remote())
            self._ranks[key] = (int(info.get("tp_size", 1)), info.get("weight_wire", "embedded"))
        return self._ranks[key]

    def push(
        self,
        engine: Any,
        named: NamedTensors,
        version: int,
        bucket_bytes: int,
        flush_cache: bool,
        gather: HandleGather,
        resident: bool,
        model: torch.nn.Module | None = None,
        wire: str = "embedded",
    ) -> dict[str, Any] | None:
        """Collective over the train ranks (each iterates the same full tensors);
        rank 0 returns bytes, buckets and the path taken. ``model``: a single rank's
        model, whose tensors the staging buffer may take over (``Staging.bind``).
        ``wire``: the engine's payload format (an SGLang server keeps no handles, so
        every push to it streams)."""
        if not resident:
            self.close()
        elif self.layout is not None:
            return self._push_resident(engine, named, version, flush_cache, gather, model)
        layout = None
        if resident and not self._no_room:  # learn the layout while the first push streams
            layout, named = Layout.record(named)
        out = send_streamed(engine, named, version, bucket_bytes, flush_cache, gather, wire)
        # One rank decides alone; ranks of a sharded trainer must agree, so they do not check.
        if layout is not None and gather.world == 1 and not has_room(layout.nbytes(), self.device):
            log.warning(
                "no room for a %d-byte staging buffer on %s: weight pushes stream per bucket",
                layout.nbytes(),
                self.device,
            )
            self._no_room, layout = True, None
        self.layout = layout  # complete only once the push went through
        return None if out is None else {**out, "path": "streamed"}

    def _push_resident(
        self,
        engine: Any,
        named: NamedTensors,
        version: int,
        flush_cache: bool,
        gather: HandleGather,
        model: torch.nn.Module | None,
    ) -> dict[str, Any] | None:
        nbytes, bound = 0, False
        if gather.producer:
            if self.staging is None:
                self.staging = Staging(self.layout, self.device, self.channel)
                self._bind = model is not None  # try once per buffer
            st = self.staging
            if self._bind and (st.bound(model) or _try_bind(st, model)):
                nbytes, bound = st.ready(), True  # the weights are the buffer: no copy
            else:
                self._bind = False
                nbytes = st.fill(named)
        else:
            for _ in named:  # join the collectives of the iteration (FSDP gathers)
                pass
        key = engine_key(engine)
        status, signal = None, "ray"
        for attempt in range(2):
            mine = None
            if gather.producer:
                mine = self.staging.handle(full=attempt > 0 or key not in self.staging.acked)
            handles = gather.to_rank0(mine)
            status = None
            if handles is not None:
                try:
                    reply, signal = self._signals.update(
                        engine, key, handles, flush_cache, str(version)
                    )
                    if reply.get("cache_miss") and attempt == 0:
                        status = "miss"  # the engine was restarted: send everything again
                    else:
                        _check(reply, f"v{version}")
                except Exception as e:  # every rank must hear of it, or they would wait
                    status = f"{type(e).__name__}: {e}"
            status = gather.ack(status)
            if status != "miss":
                break
        if status is not None:
            raise RuntimeError(status)
        if gather.producer:
            self.staging.acked.add(key)
        out = {"bytes": nbytes, "buckets": 1, "path": "resident", "signal": signal, "bound": bound}
        return out if gather.rank == 0 else None

    def close(self) -> None:
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        self._signals.close()


def _try_bind(staging: Staging, model: torch.nn.Module) -> bool:
    try:
        return staging.bind(model)
    except (RuntimeError, TypeError):  # rolled back; the buffer is filled at each push
        return False


def _hand_over(
    flats: list[FlatBucket], gather: HandleGather, wire: str, call: Any, what: str
) -> None:
    """One bucket to the engine: each producing rank makes its handle (a shared-memory
    segment, a CUDA IPC handle or SGLang's payload), rank 0 makes ``call(handles)``
    (a Ray call whose reply must say success) and every rank hears the outcome.
    Collective over the train ranks; the producer's memory is freed on return."""
    on_gpu = flats[0].flat.is_cuda
    shm = not on_gpu and gather.producer and wire != "sglang"
    segment = ShmSegment(flats) if shm else None
    error = None
    try:
        mine = None
        if gather.producer:
            if on_gpu and wire != "sglang":  # the engine reads the flats on its stream
                torch.cuda.current_stream().synchronize()
            # SGLang needs no wait here: torch's CUDA IPC reduction records an event
            # on this stream as it pickles, and the server's rebuild waits on it, so
            # pickling and the post overlap the flatten's copy (as the seed's push).
            if wire == "sglang":
                mine = _sglang_payload(flats, on_gpu)
            else:
                mine = _ipc_handle(flats) if on_gpu else segment.handle
        handles = gather.to_rank0(mine)
        if handles is not None:
            try:
                _check(ray.get(call(handles)), what)
            except Exception as e:  # every rank must hear of it, or they would wait
                error = f"{type(e).__name__}: {e}"
        error = gather.ack(error)
    finally:  # the engine has copied (or failed): the producer's memory may go
        if segment is not None:
            segment.close()
    if error is not None:
        raise RuntimeError(error)


def send_streamed(
    engine: Any,
    named: NamedTensors,
    version: int,
    bucket_bytes: int,
    flush_cache: bool,
    gather: HandleGather,
    wire: str = "embedded",
) -> dict[str, Any] | None:
    """Hand every bucket to ``engine`` (same host), one call per bucket. Collective over
    the train ranks (each iterates the same full tensors); rank 0 returns bytes and
    bucket count. ``wire: sglang``: each handle is SGLang's own payload
    (``wire.sglang_payload``), CUDA only."""
    nbytes = nbuckets = 0
    for bucket, last in _with_last(iter_buckets(named, bucket_bytes)):
        flats = flatten(bucket)

        def call(handles: list, last: bool = last) -> Any:
            return engine.update_weights_from_tensor.remote(
                handles,
                flush_cache=flush_cache and last,
                weight_version=str(version) if last else None,
            )

        _hand_over(flats, gather, wire, call, f"bucket {nbuckets} of v{version}")
        nbytes += sum(b.flat.numel() * b.flat.element_size() for b in flats)
        nbuckets += 1
    return {"bytes": nbytes, "buckets": nbuckets} if gather.rank == 0 else None


def send_adapter(
    engine: Any,
    named: NamedTensors,
    version: int,
    config: dict[str, Any],
    flush_cache: bool,
    gather: HandleGather,
    wire: str = "embedded",
) -> dict[str, Any] | None:
    """Hand a LoRA adapter (``named``: peft's names; ``config``: its peft config) to
    ``engine`` as adapter ``v{version}`` in one bucket: an adapter is a few MB, and an
    engine applies it whole. Collective as ``send_streamed``; rank 0 returns bytes."""
    from wire.lora import adapter_name, bucket_checksums

    flats = flatten(named)
    expected = bucket_checksums(flats)  # the engine checks what it received (a few MB)

    def call(handles: list) -> Any:
        return engine.load_lora_adapter_from_tensors.remote(
            adapter_name(version),
            config,
            handles,
            load_format="flattened_bucket",
            flush_cache=flush_cache,
            expected_checksums=expected,
        )

    _hand_over(flats, gather, wire, call, f"adapter v{version}")
    nbytes = sum(b.flat.numel() * b.flat.element_size() for b in flats)
    return {"bytes": nbytes, "buckets": 1, "path": "adapter"} if gather.rank == 0 else None
