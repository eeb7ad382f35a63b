"""Engine side of a ``tensor`` push: opened buckets kept across updates, and the copy.

Owns ``ReceiverCache`` (one per receiving rank, held by what receives there:
the engine's ``InMemoryUpdates`` and each ``EngineRank``) and ``CopyPlan``. A
producer that keeps one staging buffer for the whole model
(``training.weight_staging``) marks its handles with ``cache = {"channel",
"key"}``: the first handle of a key carries everything
(IPC bytes or segment path, metadata) and is opened once; later handles of the
same key may leave the metadata out, and the opened memory, the checked names
and shapes and the source views are reused. The receiver keeps one entry (each
receiver rank is fed by one producer rank): a new key drops the old entry,
which releases the producer's memory. A handle whose key this receiver does not
hold (an engine restarted since) raises ``CacheMiss``; the producer resends it
in full. A handle without ``cache`` is opened, copied and dropped (streamed pushes).

For a cached key on a single-rank engine, the engine's weights are bound into
local flat buffers with the producer's layout (``wire.flat_binding``): an
update is one device copy per dtype. Otherwise the copy is one
``torch._foreach_copy_`` into the model's own tensors, resolved by (module,
attribute) at every update, so a model whose tensors moved (a sleep that moved
them to the host and back) is still written in place. Names
and shapes are checked when a plan is built, before the first copy, so a bad
bucket leaves the model untouched. Never decides versions and never frees the
producer's memory. Pure torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from engines.embedded import tensor_parallel as tpar
from wire import receiver as wr
from wire.errors import WeightLoadError
from wire.flat_binding import FlatPlan, adopt, resolve

log = logging.getLogger(__name__)


class CacheMiss(WeightLoadError):
    """A handle names a cached bucket this receiver does not hold; resend it in full."""


@dataclass
class CopyPlan:
    """Sources (views of the producer's memory, this rank's TP slice) and where they go."""

    targets: list[tuple[torch.nn.Module, str]]  # (module, attribute) per copied tensor
    shapes: list[torch.Size]  # each target's shape, checked at build time
    sources: list[torch.Tensor]  # same order as targets
    nbytes: int  # bytes copied per update
    ntensors: int  # tensors named by the handle (aliases included)

    @torch.no_grad()
    def copy(self) -> int:
        """Copy every source into the model; returns bytes. Waits for the device, so
        the producer may overwrite or free its memory once this returned."""
        dsts = [getattr(m, a) for m, a in self.targets]
        for d, s in zip(dsts, self.shapes):
            if d.shape != s:  # the model was rebuilt under us: refuse rather than corrupt
                raise WeightLoadError(f"a model tensor changed shape to {tuple(d.shape)}")
        groups: dict[tuple, tuple[list, list]] = {}
        for d, s in zip(dsts, self.sources):  # one fused copy per (device, dtype) pair
            g = groups.setdefault((d.device, d.dtype, s.dtype), ([], []))
            g[0].append(d)
            g[1].append(s)
        for d, s in groups.values():
            torch._foreach_copy_(d, s)
        if any(d.is_cuda for d in dsts):
            torch.cuda.current_stream().synchronize()
        return self.nbytes


def build_plan(
    model: torch.nn.Module,
    resolved: dict[str, tuple[torch.nn.Module, str]],
    named: list[tuple[str, torch.Tensor]],
    rank: int,
    tp: int,
) -> CopyPlan:
    """Check every name and shape, then pair each source with its target. A target
    named twice (tied embeddings sent under both names) is copied once."""
    bad = []
    targets, shapes, sources, seen = [], [], [], set()
    nbytes = 0
    for name, t in named:
        loc = resolved.get(name)
        src = tpar.shard_tensor(name, t, rank, tp)
        dst = getattr(*loc) if loc is not None else None
        if dst is None or dst.shape != src.shape:
            bad.append(name)
            continue
        if id(dst) in seen:
            continue
        seen.add(id(dst))
        targets.append(loc)
        shapes.append(dst.shape)
        sources.append(src)
        nbytes += src.numel() * src.element_size()
    if bad:
        raise WeightLoadError(f"bucket does not fit the model: {bad[:5]} ({len(bad)})")
    return CopyPlan(targets, shapes, sources, nbytes, len(named))


@dataclass
class _Entry:
    key: str  # the producer's staging key
    buckets: list  # opened FlatBuckets (views of the producer's memory)
    plans: dict[tuple[int, int, int], CopyPlan] = field(
        default_factory=dict
    )  # by (model, rank, tp)


class ReceiverCache:
    """Opened buckets by producer channel, and name resolution of the model; ``apply``
    copies one handle with them."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._model: Any = None
        self._resolved: dict[str, tuple[torch.nn.Module, str]] = {}

    def _names(self, model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
        if self._model is not model:
            self._model, self._resolved = model, resolve(model)
        return self._resolved

    def plan(
        self,
        model: torch.nn.Module,
        handle: dict[str, Any],
        device: torch.device,
        rank: int,
        tp: int,
    ) -> CopyPlan | FlatPlan:
        """The copy plan of ``handle`` for this rank; opened and checked once per key."""
        cache = handle.get("cache")
        if cache is None:
            named = wr.named_tensors(wr.open_bucket(handle, device))
            return build_plan(model, self._names(model), named, rank, tp)
        channel, key = cache["channel"], cache["key"]
        entry = self._entries.get(channel)
        if entry is None or entry.key != key:
            # Each receiver rank is fed by one producer rank at a time: a new key (or a
            # new producer, e.g. a restarted trainer) replaces whatever was open, which
            # releases the old producer memory and the flats the model was bound into.
            self._entries.clear()
            if any(p.get("metadata") is None for p in handle["parts"]):
                raise CacheMiss(f"weight cache miss: key {key} is not open here; resend in full")
            entry = self._entries[channel] = _Entry(key, wr.open_bucket(handle, device))
        slot = (id(model), rank, tp)
        plan = entry.plans.get(slot)
        if plan is None or (isinstance(plan, FlatPlan) and not plan.valid()):
            # A single-rank engine binds its weights into flats of the producer's
            # layout (one copy per dtype); if they moved since (a sleep), it binds again.
            plan = None
            if tp == 1:
                try:
                    plan = adopt(self._names(model), entry.buckets)
                except (RuntimeError, TypeError) as e:  # rolled back: copy tensor by tensor
                    log.warning(
                        "cannot bind the weights into flat buffers (%s); copying per tensor", e
                    )
            if plan is None:
                named = wr.named_tensors(entry.buckets)
                plan = build_plan(model, self._names(model), named, rank, tp)
            entry.plans[slot] = plan
        return plan

    def apply(
        self,
        model: torch.nn.Module,
        handle: dict[str, Any],
        device: torch.device,
        rank: int,
        tp: int,
    ) -> tuple[int, int]:
        """Copy this rank's slice of ``handle`` into ``model``; (tensors, bytes). A
        handle that does not ask to be kept is dropped after."""
        try:
            plan = self.plan(model, handle, device, rank, tp)
            nbytes = plan.copy()
        except WeightLoadError:
            self.drop(handle)
            raise
        if not (handle.get("cache") or {}).get("keep", False):
            self.drop(handle)
        return plan.ntensors, nbytes

    def channels(self) -> list[str]:
        """The producer channels whose buckets are held open."""
        return list(self._entries)

    def drop(self, handle: dict[str, Any]) -> None:
        """Forget the entry of ``handle``'s channel (the producer will free or reuse it)."""
        cache = handle.get("cache")
        if cache is not None:
            self._entries.pop(cache["channel"], None)

    def clear(self) -> None:
        self._entries.clear()
        self._model, self._resolved = None, {}
