"""What a trainer compiles on before its first step: a small batch of the run's shape.

``torch.compile`` builds a step's kernels (compiled decoder layers, the fused
log-prob kernel) when they first run: at the first step, tens of seconds on a
GPU. A trainer that runs its passes once on this batch while it is built pays
that time where nothing waits for it (in a new run, beside the engines' start)
and gives every later step, and a resumed process's first one, the same
kernels. The batch has two prompts of two samples each with differing rewards,
so every path of the loss runs, and responses of two lengths, so it is padded
and carries an attention mask as a run's batches do (a batch without padding
passes none, a case compiled apart); two rows and two response tokens or more,
as dynamic shapes specialise sizes 0 and 1. Never read or written to storage.
"""

from __future__ import annotations

from rollout.types import RolloutBatch, Sample

ROWS = 2  # samples per prompt, and prompts


def warm_up_batch(vocab_size: int, temperature: float) -> RolloutBatch:
    """A rollout batch of token ids below ``vocab_size``, sampled at ``temperature``."""
    samples = [
        Sample(
            p,
            j,
            prompt_ids=[(1 + p + i) % vocab_size for i in range(6)],
            response_ids=[(7 + j + i) % vocab_size for i in range(3 + j)],
            response_logprobs=[-1.0] * (3 + j),
            reward=float(j),
            weight_version=0,
            finish_reason="length",
        )
        for p in range(ROWS)
        for j in range(ROWS)
    ]
    return RolloutBatch(0, ROWS, samples, temperature=temperature)
