"""Trainer side of a resident ``tensor`` push: one staging buffer for the whole model.

Owns ``Layout`` (the names, shapes and dtypes a push carries, learnt from the
first push) and ``Staging``: one flat buffer per dtype holding every tensor of
the layout, allocated and registered once, then refilled at each update with
one fused copy per dtype. On GPU each flat buffer is exported as a CUDA IPC
handle once (its pickled bytes are kept); on CPU the buffers are views of one
shared-memory segment. The handles carry ``cache = {channel, key, keep}`` so the
engine keeps them open (``engines.embedded.weight_cache``): an update is then one fill,
one Ray call and one copy on the engine, whatever the number of tensors.

Memory: a single train rank binds its weights into the staging buffer
(``bind``: its parameters become views of it, ``wire.flat_binding``), so the
buffer costs nothing extra and an update needs no fill at all. Sharded or
converted weights (FSDP, megatron) are copied in at each update (``fill``), and
the buffer is then a second copy of the model for as long as the trainer keeps
it; only a trainer that never sleeps keeps one (colocated ranks stream per
bucket instead, ``training.weight_sender``). A shared-memory segment's file
name carries the producer's pid; files of dead producers are removed when a new
segment is made, so a killed actor leaves nothing behind for long.

Never calls the engine and never decides versions.
"""

from __future__ import annotations

import glob
import io
import os
import tempfile
import uuid
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from wire.flat_binding import Binding, binding, is_bound, rebind, resolve
from wire.flat_bucket import TensorMeta, dtype_name
from wire.receiver import SHM_PREFIX

ALIGN = 64
PENDING_BYTES = 256 << 20  # tensors held before one fused copy (gathered ones are fresh memory)


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def segment_path() -> str:
    """A new segment name: the producer's pid first, so a sweep can tell dead ones."""
    return os.path.join(shm_dir(), f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")


def sweep_dead_segments() -> int:
    """Remove segments whose producer process is gone (a killed actor cannot unlink)."""
    removed = 0
    for path in glob.glob(os.path.join(shm_dir(), f"{SHM_PREFIX}*-*")):
        pid = os.path.basename(path)[len(SHM_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
        except PermissionError:  # alive, another user's
            pass
    return removed


def has_room(nbytes: int, device: torch.device, margin: int = 64 << 20) -> bool:
    """Whether a staging buffer of ``nbytes`` fits: free device memory on GPU, free
    space in the shared-memory folder on CPU (a container's /dev/shm is often
    small, and touching a page past its limit kills the process with SIGBUS)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        st = os.statvfs(shm_dir())
        free = st.f_bavail * st.f_frsize
    return free >= nbytes + margin


@dataclass(frozen=True)
class Slot:
    name: str  # state-dict name
    shape: tuple[int, ...]
    dtype: torch.dtype
    alias_of: int | None  # index of an earlier slot holding the same tensor (tied weights)


class Layout:
    """What a push carries, in order; ``matches`` tells whether it still does."""

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots

    @classmethod
    def record(cls, named: Iterable[tuple[str, torch.Tensor]]) -> tuple[Layout, Iterator]:
        """An empty layout, and ``named`` passed through: the layout fills in as the
        caller streams it on (a push never holds more than its buckets for this)."""
        layout = cls([])
        return layout, layout.recording(named)

    def recording(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator:
        """``named`` passed through, each tensor's slot appended to this layout as it passes."""
        # Two names alias (tied weights) only if the first tensor is still alive when
        # the second comes: a gathered or converted tensor freed after its bucket
        # leaves its address to the next allocation, which is not an alias.
        seen: dict[tuple, tuple[int, weakref.ref]] = {}
        for name, t in named:
            ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.stride()))
            alias = None
            first = seen.get(ident) if t.numel() else None
            if first is not None and first[1]() is not None:
                if self.slots[first[0]].shape == tuple(t.shape):
                    alias = first[0]
            if alias is None:
                seen[ident] = (len(self.slots), weakref.ref(t))
            self.slots.append(Slot(name, tuple(t.shape), t.dtype, alias))
            yield name, t

    def nbytes(self) -> int:
        """Bytes a staging buffer for this layout holds (aliases once)."""
        total = 0
        for s in self.slots:
            if s.alias_of is None:
                n = torch.empty((), dtype=s.dtype).element_size()
                for d in s.shape:
                    n *= d
                total += n
        return total

    def check(self, i: int, name: str, t: torch.Tensor) -> None:
        if i >= len(self.slots):
            raise RuntimeError(f"push carries more tensors than its layout ({name!r} extra)")
        s = self.slots[i]
        if s.name != name or s.shape != tuple(t.shape) or s.dtype != t.dtype:
            raise RuntimeError(
                f"tensor {i} is {name!r} {tuple(t.shape)} {t.dtype}, the layout says "
                f"{s.name!r} {s.shape} {s.dtype}: the model changed under the staging buffer"
            )


class Staging:
    """Flat buffers per dtype for a ``Layout`` on ``device``; see the module docstring."""

    def __init__(self, layout: Layout, device: torch.device, channel: str) -> None:
        self.layout, self.device, self.channel = layout, device, channel
        self.key = uuid.uuid4().hex  # a new buffer is a new key: receivers reopen it
        self.acked: set[str] = set()  # engines that hold this key open
        sizes: dict[torch.dtype, int] = {}
        self.where: list[tuple[int, int, int]] = []  # per slot: (part, start, end) in elements
        order: list[torch.dtype] = []
        for s in layout.slots:
            if s.dtype not in sizes:
                sizes[s.dtype] = 0
                order.append(s.dtype)
        metas: dict[torch.dtype, list[TensorMeta]] = {d: [] for d in order}
        for s in layout.slots:
            if s.alias_of is not None:  # same range as the tensor it aliases
                part, start, end = self.where[s.alias_of]
            else:
                n = 1
                for d in s.shape:
                    n *= d
                part, start, end = order.index(s.dtype), sizes[s.dtype], sizes[s.dtype] + n
                sizes[s.dtype] = end
            self.where.append((part, start, end))
            metas[s.dtype].append(
                TensorMeta(s.name, s.shape, dtype_name(s.dtype), start, end, end - start)
            )
        self.metadata = [metas[d] for d in order]
        self.path: str | None = None
        self._views: list[torch.Tensor] | None = None
        self._bindings: list[Binding] | None = None  # once bound to a model
        self._model: weakref.ref | None = None  # the model bound (a rebuilt one is not)
        if device.type == "cuda":
            self.flats = [torch.empty(sizes[d], dtype=d, device=device) for d in order]
            self._ipc = [_ipc_bytes(f) for f in self.flats]
        else:
            self._map_segment(order, sizes)

    def _map_segment(self, order: list[torch.dtype], sizes: dict[torch.dtype, int]) -> None:
        sweep_dead_segments()
        self.offsets, off = [], 0
        for d in order:
            self.offsets.append(off)
            nbytes = sizes[d] * torch.empty((), dtype=d).element_size()
            off += -(-nbytes // ALIGN) * ALIGN
        self.nbytes = max(off, ALIGN)
        self.path = segment_path()
        with open(self.path, "wb") as f:
            f.truncate(self.nbytes)
        buf = torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)
        self.flats = []
        for d, o in zip(order, self.offsets):
            n = sizes[d] * torch.empty((), dtype=d).element_size()
            self.flats.append(buf[o : o + n].view(d))

    def _view(self, i: int) -> torch.Tensor:
        if self._views is None:  # made once: an update should not pay for ~300 views
            self._views = [
                self.flats[p][a:b].view(s.shape)
                for (p, a, b), s in zip(self.where, self.layout.slots)
            ]
        return self._views[i]

    def bind(self, model: torch.nn.Module) -> bool:
        """Make ``model``'s tensors views of this buffer (values copied in first), so
        later pushes need no fill; False (nothing changed) if the layout does not
        map onto the model's tensors one to one."""
        resolved = resolve(model)
        pairs, bindings = [], []
        for i, s in enumerate(self.layout.slots):
            target = resolved.get(s.name)
            t = getattr(*target) if target is not None else None
            view = self._view(i if s.alias_of is None else s.alias_of)
            if t is None or tuple(t.shape) != s.shape or t.dtype != s.dtype:
                return False
            if t.device != view.device:
                return False
            if s.alias_of is None:
                pairs.append((target, view))
            bindings.append(binding(target, view))
        rebind(pairs)
        self._bindings, self._model = bindings, weakref.ref(model)
        return True

    def bound(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` is the model bound and its tensors are still this buffer
        (a move, such as a sleep to the host, breaks it; so does a rebuilt model)."""
        return (
            self._bindings is not None
            and self._model is not None
            and self._model() is model
            and is_bound(self._bindings)
        )

    def ready(self) -> int:
        """A bound buffer is already filled: wait for the kernels that last wrote the
        weights (the engine reads from another stream); returns the bytes it holds."""
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return self.nbytes_total

    @torch.no_grad()
    def fill(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy every tensor of ``named`` (in layout order) into its slot; returns bytes.
        One fused copy per dtype every ``PENDING_BYTES``, so tensors made for the push
        (gathered or converted) are freed as it goes."""
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        fresh = total = 0
        i = -1
        for i, (name, t) in enumerate(named):
            self.layout.check(i, name, t)
            if self.layout.slots[i].alias_of is not None:
                continue
            dsts.append(self._view(i))
            srcs.append(t)
            nbytes = t.numel() * t.element_size()
            total += nbytes
            fresh += nbytes
            if fresh >= PENDING_BYTES:
                _fused_copy(dsts, srcs)
                dsts, srcs, fresh = [], [], 0
        if i + 1 != len(self.layout.slots):
            raise RuntimeError(
                f"push carried {i + 1} tensors, its layout {len(self.layout.slots)}: "
                "the model changed under the staging buffer"
            )
        _fused_copy(dsts, srcs)
        if self.device.type == "cuda":  # the engine reads it from another stream
            torch.cuda.current_stream().synchronize()
        return total

    def handle(self, full: bool) -> dict[str, Any]:
        """The transfer handle; ``full=False`` leaves out what a receiver that holds
        this key already has (the metadata)."""
        cache = {"channel": self.channel, "key": self.key, "keep": True}
        if self.device.type == "cuda":
            parts = [
                {"handle": h, "metadata": m if full else None}
                for h, m in zip(self._ipc, self.metadata)
            ]
            return {"kind": "cuda_ipc", "cache": cache, "parts": parts}
        parts = [
            {"offset": o, "metadata": m if full else None}
            for o, m in zip(self.offsets, self.metadata)
        ]
        return {
            "kind": "shm",
            "path": self.path,
            "nbytes": self.nbytes,
            "cache": cache,
            "parts": parts,
        }

    @property
    def nbytes_total(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flats)

    def close(self) -> None:
        """Drop the buffers (receivers that still hold them keep the memory alive until
        they see a new key) and unlink the segment."""
        # A bound model keeps the memory alive: its tensors are views of it.
        self.flats, self._ipc, self._views, self._bindings = [], [], None, None
        self._model = None
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None


def _fused_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    groups: dict[tuple, tuple[list, list]] = {}
    for d, s in zip(dsts, srcs):
        g = groups.setdefault((s.device, s.dtype), ([], []))
        g[0].append(d)
        g[1].append(s)
    for d, s in groups.values():
        torch._foreach_copy_(d, s)


def _ipc_bytes(flat: torch.Tensor) -> bytes:
    """ForkingPickler bytes of a CUDA tensor (an IPC handle), as SGLang and slime send them."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the CUDA tensor reductions)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(flat)
    return buf.getvalue()
