"""Typed records of the iteration's steps, as persisted in the ledger (JSON)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class VerifyRecord:
    """``ledger/iter_k/verify-e{i}.json``: what verify saw when it last passed."""

    engine: int  # engine id
    version: int  # the version the engine must serve (and serves: the check passed)
    verified: bool  # always True: a failed check raises instead of recording
    served: str  # what the engine reported on /model_info
    rollout_weight_version: int | None  # weight_version of rollout k's samples (None: no record)
    rollout_expected: int | None  # the version those samples had to come from
    checked_at: str  # UTC ISO time of the check

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
