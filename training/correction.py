"""Rollout correction: weights for the gap between the engines' logprobs and the trainer's.

Owns the maths only: pure functions over tensors, never models, config or Ray
(``training.algorithm`` maps ``train.loss.rollout_correction`` onto them). The
engine that sampled a token and the trainer disagree on its logprob: other
kernels (SGLang's against the trainer's), another precision, or, off-policy,
older weights. The loss's importance ratio is taken against the trainer's own
logprob at the step's start; these weights correct for the rest, per token:

    log_ratio_t = trainer_t - engine_t                      (0 off the mask)
    tis        w_t = min(exp(log_ratio_t), cap)             slime --use-tis, verl
    token_mis  w_t = exp(log_ratio_t) if in [low, high], else 0
    seq_mis    w_t = exp(sum_t log_ratio_t) if in [low, high], else 0   (the row's)
    geo_mask   w_t = 1 if exp(mean_t log_ratio_t) in [low, high], else 0   (SkyRL)

Every weight is detached: it scales a token's policy-gradient term and never
carries a gradient of its own. Token tensors are [B, T] with ``mask`` 1 on
response tokens. A masked token still counts in the loss's denominator (the
step shrinks; the other tokens are not weighed up).
"""

from __future__ import annotations

import math

import torch

from training.losses import Metrics, k3_kl


def log_ratio(
    logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """log(pi_trainer / pi_engine) per token [B, T], 0 off the mask (padding never counts)."""
    return ((logprobs - rollout_logprobs) * mask.to(logprobs.dtype)).detach()


def tis_weights(log_ratio: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated IS: (min(exp(log_ratio), cap), where the cap bit) per token [B, T]."""
    ratio = torch.exp(log_ratio)
    return torch.clamp(ratio, max=cap), ratio > cap


def token_mis_weights(
    log_ratio: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level masked IS: (the ratio where it lies in [low, high] else 0, rejected)."""
    return _masked(log_ratio, low, high)


def seq_mis_weights(
    log_ratio: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level masked IS: each row's ratio is the product of its token ratios
    (``log_ratio`` is 0 off the mask); (that ratio on every token of the row, 0 where
    it leaves [low, high]; rejected)."""
    return _masked(log_ratio.sum(dim=1, keepdim=True).expand_as(log_ratio), low, high)


def geo_mask_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Geometric-mean sequence mask: (1 on every token of a row whose exp(mean log
    ratio) lies in [low, high], else 0; rejected). A row without tokens is kept."""
    lengths = mask.to(log_ratio.dtype).sum(dim=1, keepdim=True).clamp(min=1.0)
    mean = (log_ratio.sum(dim=1, keepdim=True) / lengths).expand_as(log_ratio)
    keep = _in_band(mean, low, high)
    return keep.to(log_ratio.dtype), ~keep


def _in_band(log_ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    # Compared in log space: a sequence's product of ratios overflows exp long before
    # its log leaves float range.
    return (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))


def _masked(log_ratio: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    keep = _in_band(log_ratio, low, high)
    # where, not multiply: exp of a rejected ratio may be inf, and inf * 0 is nan.
    weights = torch.where(keep, torch.exp(log_ratio), torch.zeros_like(log_ratio))
    return weights, ~keep


def correction_weights(
    kind: str,
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
    low: float,
    high: float,
) -> tuple[torch.Tensor | None, Metrics]:
    """The ``kind`` weights [B, T] (None for ``none``) of the trainer's ``logprobs``
    against the engine's, and ``rollout_correction_frac``: the share of response
    tokens truncated (tis) or rejected (the masks; a rejected row's tokens all count)."""
    if kind == "none":
        return None, {"rollout_correction_frac": 0.0}
    lr = log_ratio(logprobs, rollout_logprobs, mask)
    if kind == "tis":
        weights, changed = tis_weights(lr, cap)
    elif kind == "token_mis":
        weights, changed = token_mis_weights(lr, low, high)
    elif kind == "seq_mis":
        weights, changed = seq_mis_weights(lr, low, high)
    elif kind == "geo_mask":
        weights, changed = geo_mask_weights(lr, mask, low, high)
    else:
        raise ValueError(f"unknown rollout correction kind {kind!r}")
    m = mask.to(logprobs.dtype)
    frac = (changed.to(m.dtype) * m).sum() / m.sum().clamp(min=1.0)
    return weights, {"rollout_correction_frac": frac}


def mismatch_metrics(
    logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> Metrics:
    """Means over response tokens of |trainer - engine| (``rollout_logprob_abs_diff``)
    and of the k3 estimate of KL(engine || trainer) (``rollout_logprob_kl``, >= 0; the
    tokens were sampled by the engine, so it is the sampling side of the KL)."""
    m = mask.to(logprobs.dtype)
    count = m.sum().clamp(min=1.0)
    lp, rollout = logprobs.detach(), rollout_logprobs.detach()
    return {
        "rollout_logprob_abs_diff": (((lp - rollout).abs() * m).sum() / count).detach(),
        "rollout_logprob_kl": ((k3_kl(rollout, lp) * m).sum() / count).detach(),
    }
