"""Per-sample seeds: sampling for (seed, iteration, prompt, sample) is reproducible
whatever engine, batch or retry generates it."""

from __future__ import annotations

import hashlib


def sample_seed(seed: int, iteration: int, prompt_index: int, sample_index: int) -> int:
    digest = hashlib.sha256(f"{seed}/{iteration}/{prompt_index}/{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def turn_seed(seed: int, iteration: int, prompt_index: int, sample_index: int, turn: int) -> int:
    """The seed of turn ``turn`` of a multi-turn episode; turn 0 is ``sample_seed``."""
    if turn == 0:
        return sample_seed(seed, iteration, prompt_index, sample_index)
    key = f"{seed}/{iteration}/{prompt_index}/{sample_index}/turn{turn}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def chunk_seed(seed: int, iteration: int, prompt_index: int, sample_index: int, chunk: int) -> int:
    """The seed of chunk ``chunk`` of a partial rollout's sample (``rollout.partial``):
    the part generated after a version switch; chunk 0 is ``sample_seed``."""
    if chunk == 0:
        return sample_seed(seed, iteration, prompt_index, sample_index)
    key = f"{seed}/{iteration}/{prompt_index}/{sample_index}/chunk{chunk}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & ((1 << 63) - 1)
