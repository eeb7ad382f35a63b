"""The failure budget of a rollout, per prompt (after NeMo-RL's ``rollout_failure``).

Two kinds of failure reach a prompt while its episodes are generated:

- **infrastructure** (``EngineUnavailable``: a dead engine, a timeout, a
  dropped connection, a 5xx, an aborted request): the failed call is sent
  again, whole, to another engine; each failed call is one strike for every
  prompt in it, and a prompt with more than ``infra_retries`` strikes has failed;
- **data** (``RequestRefused``: the engine refused the request itself, e.g. a
  prompt longer than the context): the row is sent alone, up to
  ``data_retries`` more times.

A failed prompt is then replaced by a prompt of the spare pool (its own index
range per iteration, so it never meets a regular or dynamic-sampling prompt)
or dropped (``on_exhausted``). More than ``max_batch_fraction`` of the batch
failing fails the rollout (``RolloutFailed``): a broken cluster must not
silently train on a sliver of a batch. A rollout that makes no progress for
``stall_s`` fails with ``RolloutStalled``; both are step failures that the
step's retries (Prefect's, ``tasks.retries``) take.

``FailureLog`` records every retry and drop and hands its record to
``persist`` each time it changes (the rollout step writes it to the ledger as
``rollout-failures``). A retried rollout step starts from that record: the
prompts it dropped are dropped again, with the same replacements, so the
retried step builds the same batch. Infrastructure retries never change a
batch: a call is sent again with the same rows, seeds and weights.
No Prefect, Ray or engines here.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout.types import Drop, FailureRecord, Retry

# Spare prompts start at index 2**41: regular batches and dynamic sampling's
# extra rounds (from 2**40) never reach it. One block of 2**20 per iteration.
SPARE_INDEX_BASE = 1 << 41
SPARES_PER_ITERATION = 1 << 20


class VersionMismatch(RuntimeError):
    """An engine serves another weight version than the step expects."""


class EngineUnavailable(RuntimeError):
    """An engine could not serve a call (dead, timed out, unreachable, aborted):
    the call is retried on another engine."""


class RequestRefused(ValueError):
    """An engine refused a request as invalid (a 4xx, e.g. over the context length)."""


class RolloutFailed(RuntimeError):
    """More of the batch failed than ``rollout.failures.max_batch_fraction`` allows."""


class RolloutStalled(TimeoutError):
    """No episode made progress for ``rollout.failures.stall_s``."""


class FailureConfig(BaseModel):
    """``rollout.failures``: the failure budget of each prompt of a multi-turn rollout."""

    model_config = ConfigDict(extra="forbid")

    infra_retries: int = Field(
        2,
        ge=0,
        description="Failed calls (dead engine, timeout, dropped connection) a prompt "
        "survives; each is retried on another engine",
    )
    data_retries: int = Field(
        0, ge=0, description="Times a refused request (e.g. longer than the context) is sent again"
    )
    on_exhausted: Literal["replace", "drop"] = Field(
        "replace",
        description="A prompt past its budget: replaced by a spare prompt, or dropped "
        "(the batch gets smaller; train.num_workers must still divide it)",
    )
    max_batch_fraction: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Most prompts of a batch that may fail before the rollout fails",
    )
    stall_s: float = Field(
        600.0,
        gt=0,
        description="A rollout with no finished turn for this long fails (and is retried)",
    )


def spare_index(k: int, m: int) -> int:
    """Prompt index of the m-th spare of iteration k."""
    if not 0 <= m < SPARES_PER_ITERATION:
        raise ValueError(f"spare {m} is outside 0..{SPARES_PER_ITERATION - 1}")
    return SPARE_INDEX_BASE + (k - 1) * SPARES_PER_ITERATION + m


class FailureLog:
    """Strikes per prompt and the record of retries and drops of one rollout step.

    Thread-safe: the engine shares of a rollout strike from their own threads."""

    def __init__(
        self,
        cfg: FailureConfig,
        k: int,
        batch_size: int,
        persisted: dict[str, Any] | None = None,
        persist: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg, self.k, self.batch_size = cfg, k, batch_size
        self._persist = persist
        self._lock = threading.Lock()
        self._strikes: dict[tuple[int, str], int] = {}
        earlier = FailureRecord.from_json(persisted) if persisted else FailureRecord()
        self.retries: list[Retry] = list(earlier.retries)
        self.drops: list[Drop] = list(earlier.drops)
        # Drops of an earlier attempt of this step: made again, whatever happens now.
        self._replayed = {d.prompt_index: d for d in earlier.drops}

    @property
    def allowed(self) -> int:
        """Most prompts that may fail in this rollout."""
        return math.floor(self.cfg.max_batch_fraction * self.batch_size + 1e-9)

    def strike(
        self, prompts: list[int], kind: Literal["infra", "data"], turn: int, engine: int, error: str
    ) -> list[int]:
        """One failed call of ``prompts``; returns those now past their budget."""
        limit = self.cfg.infra_retries if kind == "infra" else self.cfg.data_retries
        out = []
        with self._lock:
            for p in prompts:
                n = self._strikes[(p, kind)] = self._strikes.get((p, kind), 0) + 1
                self.retries.append(Retry(p, kind, turn, engine, n, error[:300]))
                if n > limit:
                    out.append(p)
            self._save()
        return out

    def attempts(self, prompt: int, kind: str) -> int:
        with self._lock:
            return self._strikes.get((prompt, kind), 0)

    def replayed(self, prompt: int) -> bool:
        """True if an earlier attempt of this step dropped ``prompt``."""
        return prompt in self._replayed

    def drop(self, prompt: int, kind: str, error: str) -> int | None:
        """Record that ``prompt`` failed; the index of its replacement (None: dropped).
        RolloutFailed once more prompts failed than ``max_batch_fraction`` allows."""
        with self._lock:
            earlier = self._replayed.get(prompt)
            if earlier is not None:
                return earlier.replacement
            failed = len(self.drops) + 1
            if failed > self.allowed:
                raise RolloutFailed(
                    f"rollout[k={self.k}]: {failed} prompts failed, more than "
                    f"rollout.failures.max_batch_fraction={self.cfg.max_batch_fraction} of "
                    f"{self.batch_size} allows (last: prompt {prompt}, {kind}: {error[:200]}); "
                    "check the engines (their /health_generate) and the prompts, or raise the fraction"
                )
            replacement = None
            if self.cfg.on_exhausted == "replace":
                used = [d.replacement for d in self.drops if d.replacement is not None]
                replacement = spare_index(self.k, len(used))
            attempts = self._strikes.get((prompt, kind), 0)
            self.drops.append(Drop(prompt, kind, attempts, error[:300], replacement))
            self._save()
            return replacement

    def record(self) -> FailureRecord:
        with self._lock:
            return FailureRecord(retries=list(self.retries), drops=list(self.drops))

    def _save(self) -> None:  # holds the lock
        if self._persist is not None:
            record = FailureRecord(retries=list(self.retries), drops=list(self.drops))
            self._persist(asdict(record))
