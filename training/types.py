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


class RolloutMismatchError(RuntimeError):
    """The engines and the trainer score the same weights too differently to train
    (``train.mismatch.on_exceed: error``)."""


def mismatch_message(
    k: int, kl: float, max_kl: float, temperature: float, compiled_lora: bool = False
) -> str:
    """What a gate over ``train.mismatch.max_kl`` says: the figure and the usual causes.
    ``compiled_lora``: the run compiles its LoRA layers (``train.compile_layers: on``
    with ``train.lora``), a cause measured on its own, so named first."""
    known = (
        "This run compiles its LoRA layers (train.compile_layers: on with train.lora), "
        "which on one H100 scored SGLang's samples at 0.017 where eager layers scored "
        "0.0024: set train.compile_layers: auto. Other causes: "
        if compiled_lora
        else "Usual causes: "
    )
    return (
        f"rollout_logprob_kl {kl:.4g} at iteration {k} is above train.mismatch.max_kl "
        f"{max_kl:g}: the engines and the trainer score the weights that made the batch "
        f"differently, and the loss reads that gap as a policy change. {known}the "
        f"temperature (the batch was sampled at {temperature:g}, and both sides "
        "must score at it), the dtype (a trainer computing in fp32 beside an engine serving "
        "bf16: set train.compute_dtype: bfloat16), the tokenisation or chat template "
        "(rollout.chat_template), or the engine's version. Raise train.mismatch.max_kl, or "
        "set it to null, to train anyway"
    )
