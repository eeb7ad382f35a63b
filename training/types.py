"""What the train actors hand the driver side (``tasks``): torch-free.

The driver (a flow's process) catches the trainer's errors and reads the names
of the metrics a train step reports; it must not import torch to do so, so
these live here and not beside the tensor code that raises or computes them
(``training.batch``, ``training.correction``). Never imports torch or ray.
"""

from __future__ import annotations

# What a train step reports of the engine/trainer logprob mismatch, each a mean over
# response tokens (``training.correction``); the iteration's metrics row shows them
# (``tasks.steps``).
MISMATCH_METRICS = ("rollout_logprob_abs_diff", "rollout_logprob_kl", "rollout_correction_frac")


class UnusableRollout(ValueError):
    """A rollout batch whose rewards give no finite advantage (a reward beyond
    float32, or one whose sums overflow). Training on it would make the weights
    NaN, and a persisted batch is reused by every retry: the caller names its file
    and how to generate it again."""
