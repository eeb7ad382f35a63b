"""Sleep and wake of one actor's device memory, for colocated placement.

A colocated train rank and engine rank share a device and take turns on it:
the one that sleeps frees the memory its weights (and optimizer state) hold.
The same calls run on every device; what a sleep does depends on it:

- ``cpu``: nothing to free. Only the state changes, so a CPU run makes the
  exact call sequence of a GPU run (and tests can check it).
- ``saver`` (CUDA with torch_memory_saver importable): tensors that live in
  the saver's tagged region are paused (physical memory freed, virtual
  addresses and, through its CPU backup, contents kept) and resumed in place.
  Tensors allocated outside the region (a model built before the first sleep,
  optimizer state created by a step) are moved to the host instead and come
  back inside the region, so from the next cycle on a sleep is a pause.
- ``move`` (CUDA without it): ``.to("cpu")`` and back, then ``empty_cache``.

Each actor that takes turns owns one ``DeviceMemory``, made with the actor
(``TrainActor``, ``EmbeddedEngine`` and each ``EngineRank`` hold it as
``memory``): a new actor is awake. The mechanism is picked at the first sleep,
wake or report, so an actor that never takes turns never loads
torch_memory_saver. Pure torch; never imports Ray or Prefect.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any, Literal

import torch

log = logging.getLogger(__name__)

Mode = Literal["cpu", "move", "saver"]


def _saver() -> Any | None:
    """torch_memory_saver's process-wide saver, or None where it cannot work here."""
    try:
        import torch_memory_saver
    except ImportError:
        return None
    saver = torch_memory_saver.torch_memory_saver
    # "preload" needs the hook library in LD_PRELOAD before the process started
    # (SGLang does that for its own subprocesses); Ray actors use torch's
    # pluggable-allocator hook instead. Only settable before first use.
    preloaded = "torch_memory_saver" in os.environ.get("LD_PRELOAD", "")
    try:
        saver.hook_mode = "preload" if preloaded else "torch"
    except (AssertionError, AttributeError):
        pass  # already initialized in this process
    return saver


class DeviceMemory:
    """Awake/asleep state of one actor's tensors on ``device``; see the module docstring.
    ``mode`` forces a mechanism; None picks it by device at first use."""

    def __init__(self, device: torch.device, tag: str, mode: Mode | None = None) -> None:
        self.device = device
        self.tag = tag  # the saver's region tag ("train", "weights")
        self.state: Literal["awake", "asleep"] = "awake"
        self.transitions = 0  # sleeps + wakes that changed the state
        self._asked = mode
        self._mode: Mode | None = None  # picked at first use
        self._saver: Any | None = None
        self._in_region: set[int] = set()  # data_ptrs the saver's region allocated
        self._on_host = False  # tensors were moved to the host at the last sleep

    @property
    def mode(self) -> Mode:
        """The mechanism (``cpu``, ``saver`` or ``move``), picked at first use."""
        if self._mode is None:
            cuda, asked = self.device.type == "cuda", self._asked
            self._saver = _saver() if cuda and asked in (None, "saver") else None
            if asked is None:
                asked = "cpu" if not cuda else ("saver" if self._saver else "move")
            self._mode = asked
        return self._mode

    @property
    def has_slept(self) -> bool:
        """Whether this actor ever slept (a colocated actor)."""
        return self.transitions > 0

    def sleep(
        self, modules: list[torch.nn.Module | None], optim: torch.optim.Optimizer | None = None
    ) -> dict[str, Any]:
        """Free the device memory of ``modules`` and ``optim``'s state. Idempotent."""
        if self.state == "asleep":
            return self.report(changed=False)
        if self.mode == "saver":
            try:
                self._sleep_saver(modules, optim)
            except Exception as e:  # the saver could not start here (e.g. expandable_segments)
                if self._in_region:
                    raise
                log.warning("torch_memory_saver unusable (%s); moving tensors to the host", e)
                self._mode = "move"
        if self.mode == "move":
            _move(modules, optim, torch.device("cpu"))
            torch.cuda.empty_cache()
        self.state = "asleep"
        self.transitions += 1
        return self.report(changed=True)

    def wake(
        self, modules: list[torch.nn.Module | None], optim: torch.optim.Optimizer | None = None
    ) -> dict[str, Any]:
        """Bring back what ``sleep`` freed, contents unchanged. Idempotent."""
        if self.state == "awake":
            return self.report(changed=False)
        if self.mode == "saver":
            self._saver.resume(self.tag)
            if self._on_host:
                with self._saver.region(tag=self.tag, enable_cpu_backup=True):
                    _move(modules, optim, self.device)
                self._in_region = {_ptr(t) for t in _tensors(modules, optim)}
                self._on_host = False
        elif self.mode == "move":
            _move(modules, optim, self.device)
        self.state = "awake"
        self.transitions += 1
        return self.report(changed=True)

    def _sleep_saver(self, modules: list, optim: torch.optim.Optimizer | None) -> None:
        on_device = {_ptr(t) for t in _tensors(modules, optim) if t.device.type == "cuda"}
        if not on_device <= self._in_region:
            # Some tensors were allocated outside the region: to the host with
            # everything (they come back inside it at the next wake).
            _move(modules, optim, torch.device("cpu"))
            self._on_host = True
        torch.cuda.synchronize()
        # Also releases the region's cached blocks the move above freed.
        self._saver.pause(self.tag)
        torch.cuda.empty_cache()

    def report(self, changed: bool) -> dict[str, Any]:
        """State, mechanism and the device's memory now (zeros on CPU), for callers and tests."""
        out: dict[str, Any] = {
            "state": self.state,
            "mode": self.mode,
            "changed": changed,
            "transitions": self.transitions,
            "allocated_bytes": 0,
            "device_used_bytes": 0,
        }
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            out["allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            # Device-wide and physical: what a colocated neighbour can use. The
            # saver keeps paused tensors "allocated" to torch, so this is the
            # figure that shows its effect.
            out["device_used_bytes"] = total - free
        return out


def _tensors(modules: list, optim: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    for m in modules:
        if m is not None:
            yield from m.parameters()
            yield from m.buffers()
    if optim is not None:
        for state in optim.state.values():
            yield from (v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step")


def _ptr(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor under FSDP2
    return local.data_ptr()


def _move(modules: list, optim: torch.optim.Optimizer | None, device: torch.device) -> None:
    for m in modules:
        if m is not None:
            m.to(device)
    if optim is not None:
        for state in optim.state.values():
            for key, value in state.items():
                # Adam's "step" counter stays where the optimizer keeps it.
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device)
