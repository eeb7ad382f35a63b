"""Model tensors that live inside one flat buffer per dtype (the bucket layout).

Owns rebinding a model's parameters and buffers as views of a flat buffer laid
out like a ``flattened_bucket`` (``wire.flat_bucket``), and checking that
they still are. Both ends of a resident ``tensor`` push use it:

- the trainer binds its weights into its staging buffer, so an update needs no
  fill: the buffer the engine has open *is* the weights (``training.weight_staging``);
- the engine binds its weights into a local flat buffer with the producer's
  layout, so an update is one device copy per dtype instead of one per tensor
  (``FlatPlan``, used by ``engines.embedded.weight_cache``).

A binding breaks when something replaces a tensor's storage (a sleep that moved
the weights to the host and back, a rebuilt model); ``is_bound`` sees it and the
caller binds again or copies tensor by tensor. Values never change here: every
tensor is copied into its view before it is rebound. Pure torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Target = tuple[torch.nn.Module, str]  # (owning module, attribute name)


def resolve(model: torch.nn.Module) -> dict[str, Target]:
    """State-dict name -> (owning module, attribute), for params and persistent buffers."""
    out = {}
    for name in model.state_dict():
        prefix, _, leaf = name.rpartition(".")
        out[name] = (model.get_submodule(prefix) if prefix else model, leaf)
    return out


def _set(target: Target, value: torch.Tensor) -> None:
    module, attr = target
    current = getattr(module, attr)
    if isinstance(current, torch.nn.Parameter):
        current.data = value  # the Parameter object (and the optimizer's state key) stays
    else:
        module._buffers[attr] = value


@torch.no_grad()
def rebind(pairs: Sequence[tuple[Target, torch.Tensor]]) -> None:
    """Copy each target into its view, then make the view its storage. All or nothing:
    a failure puts back the tensors already rebound."""
    done: list[tuple[Target, torch.Tensor]] = []
    try:
        for target, view in pairs:
            old = getattr(*target).data
            view.copy_(old)
            _set(target, view)
            done.append((target, old))
    except Exception:
        for target, old in reversed(done):
            _set(target, old)
        raise


# (the module's _parameters or _buffers dict, attribute name, data pointer of its view)
Binding = tuple[dict, str, int]


def binding(target: Target, view: torch.Tensor) -> Binding:
    """What ``is_bound`` checks for ``target`` bound to ``view``."""
    module, attr = target
    slots = module._parameters if attr in module._parameters else module._buffers
    return (slots, attr, view.data_ptr())


def is_bound(bindings: Sequence[Binding]) -> bool:
    """Whether every target still starts at the data pointer it was bound to.
    Checked before every update, so it reads the module's own dicts: going through
    ``nn.Module.__getattr__`` cost about 4 us a tensor, 1 ms an update on a 0.5B model."""
    for slots, attr, ptr in bindings:
        t = slots.get(attr)
        if t is None or t.data_ptr() != ptr:
            return False
    return True


@dataclass
class FlatPlan:
    """An engine's weights bound into local flat buffers with the producer's layout:
    one device copy per dtype per update."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]  # (local flat, producer's flat)
    bindings: list[Binding]  # each target and the data pointer of its view
    nbytes: int  # bytes copied per update
    ntensors: int  # tensors named by the handle (aliases included)

    def valid(self) -> bool:
        return is_bound(self.bindings)

    @torch.no_grad()
    def copy(self) -> int:
        for local, src in self.pairs:
            local.copy_(src)
        if self.pairs and self.pairs[0][0].is_cuda:
            torch.cuda.current_stream().synchronize()  # the producer may overwrite after this
        return self.nbytes


def adopt(resolved: dict[str, Target], buckets: Sequence) -> FlatPlan | None:
    """Bind the model's tensors named by ``buckets`` (FlatBuckets) into local flats of
    the same layout; None (nothing changed) when the layout does not map one to one
    onto the model's tensors (other dtypes or shapes, overlapping ranges, a name the
    model lacks, ranges shared by two different tensors)."""
    plan_pairs, rebinds, bindings, ntensors = [], [], [], 0
    for bucket in buckets:
        flat = bucket.flat
        local = torch.empty_like(flat)
        ranges: dict[tuple[int, int], Target] = {}
        last_end = 0
        for m in sorted(bucket.metadata, key=lambda m: (m.start, m.end)):
            ntensors += 1
            target = resolved.get(m.name)
            if target is None:
                return None
            t = getattr(*target)
            if t.dtype != flat.dtype or tuple(t.shape) != tuple(m.shape) or t.device != flat.device:
                return None
            seen = ranges.get((m.start, m.end))
            if seen is not None:  # an alias (tied weights) must be the same tensor
                if getattr(*seen) is not t:
                    return None
                continue
            if m.start < last_end:
                return None
            ranges[(m.start, m.end)] = target
            last_end = m.end
            rebinds.append((target, local[m.start : m.end].view(m.shape)))
        plan_pairs.append((local, flat))
    nbytes = sum(loc.numel() * loc.element_size() for loc, _ in plan_pairs)
    rebind(rebinds)
    bindings = [binding(target, view) for target, view in rebinds]
    return FlatPlan(plan_pairs, bindings, nbytes, ntensors)
