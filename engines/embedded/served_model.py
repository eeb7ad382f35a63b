"""The model an embedded engine serves, as its generation and its weight updates share it.

Owns the references and the two locks that generation (``engines.embedded.batching``)
and weight updates (``EmbeddedEngine.update_weights_from_disk``,
``engines.embedded.memory_updates``) both need, and nothing else:

- ``step_lock`` is held by every forward and by every weight swap, so no
  forward sees a half-updated model;
- ``cond`` guards the weight version and the batcher's queue: a version changes
  in the same critical section that counts the requests its update pauses, and
  a finished request reports the version it ended on.

The engine makes one and hands it to its collaborators at construction. Never
loads, queues or decodes anything.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from engines.embedded.decode import ModelRunner
from engines.embedded.engine_ranks import EngineRanks, TPRunner


@dataclass
class ServedModel:
    """One engine's model, the ranks it spans, its weight version and its locks."""

    model: torch.nn.Module  # rank 0's model (its tensor-parallel shard when ranks is set)
    device: torch.device  # where the model lives
    ranks: EngineRanks | None  # ranks 1..tp_size-1; None for a single-rank engine
    version: str  # the weight version served; written under cond
    cond: threading.Condition = field(default_factory=threading.Condition)
    step_lock: threading.Lock = field(default_factory=threading.Lock)

    def runner(self) -> ModelRunner:
        """One decode call's forwards: on every rank when the engine spans several."""
        return ModelRunner(self.model) if self.ranks is None else TPRunner(self.model, self.ranks)
