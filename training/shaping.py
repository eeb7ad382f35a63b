"""DAPO's length handling: the soft overlong penalty and overlong filtering.

Owns reward shaping and sample filtering that depend on response length only;
pure functions over tensors and finish reasons. Never touches models, storage,
config or Ray. DAPO's dynamic sampling (dropping all-equal groups and sampling
more) needs new rollouts and is the rollout's job, not this module's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO (Yu et al. 2025) soft overlong punishment, added to the reward [B].

    With L = ``lengths`` (response tokens, eos included), L_max = ``max_len``
    (the generation budget) and L_cache = ``cache_len``::

        0                                 if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache if L_max - L_cache < L <= L_max
        -1                                if L > L_max

    so the penalty falls linearly from 0 to -1 over the last ``cache_len``
    tokens of the budget. verl's extra penalty factor is left out (it is 1).
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(
            f"overlong cache_len {cache_len} must be in 1..max_len ({max_len}); "
            "set train.loss.overlong_buffer below train.loss.max_response_tokens"
        )
    expected = max_len - cache_len
    excess = lengths.float() - expected
    return torch.clamp(-excess / cache_len, min=-1.0, max=0.0)


def overlong_keep(finish_reasons: Sequence[str]) -> torch.Tensor:
    """DAPO overlong filtering: 0.0 for a truncated sample (finish_reason "length"),
    else 1.0, [B]. Multiplied into the loss mask, so a truncated sample adds no
    loss and no tokens to the denominator; it still counts in its group's baseline
    (as in verl), since its reward was observed."""
    return torch.tensor([0.0 if r == "length" else 1.0 for r in finish_reasons])
