"""The one place a ``LossConfig`` picks the RL algorithm's pure functions.

Owns the mapping from config to policy loss (``training.losses``) with its
rollout correction (``training.correction``), advantage estimator
(``training.advantages``) and DAPO's length shaping (``training.shaping``); the trainer and the batch builder call only these three
functions. Holds no maths of its own and never touches models, storage or Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from training import advantages as adv
from training import correction, losses
from training.loss_config import LossConfig
from training.losses import Metrics
from training.shaping import overlong_keep, overlong_penalty

_ESTIMATORS = {
    "grpo": adv.grpo_advantages,
    "dr_grpo": adv.dr_grpo_advantages,
    "rloo": adv.rloo_advantages,
    "reinforce_pp": adv.reinforce_pp_advantages,
    "reinforce_pp_baseline": adv.reinforce_pp_baseline_advantages,
}


def policy_loss(
    cfg: LossConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """The ``cfg.kind`` loss of one micro-batch ([B, T] tokens, [B] advantages).

    ``num_tokens`` / ``num_sequences``: the whole batch's response tokens and
    sequences divided by the data-parallel size, so that micro-batch losses sum
    to the batch loss; token-level kinds use the first, per-sequence kinds the
    second. None means this call's own counts.

    ``rollout_logprobs`` [B, T]: the engines' logprobs of the sampled tokens. Given,
    the metrics hold the mismatch of ``logprobs`` (the trainer's at the step's
    start) against them, and ``cfg.rollout_correction`` weighs each token's term.
    """
    rc = cfg.rollout_correction
    if rc.kind != "none" and rollout_logprobs is None:
        raise ValueError(f"train.loss.rollout_correction {rc.kind} needs the engines' logprobs")
    weights, extra = None, {}
    if rollout_logprobs is not None:
        weights, extra = correction.correction_weights(
            rc.kind, old_logprobs, rollout_logprobs, mask, rc.cap, rc.low, rc.high
        )
        # Against this forward's own logprobs: the trainer's at the step's start (one
        # optimizer step per batch), whatever the ratio divides by (off-policy without a
        # correction, the engines' own, which would measure nothing).
        extra.update(correction.mismatch_metrics(logprobs, rollout_logprobs, mask))
    loss, metrics = _loss_of_kind(
        cfg,
        (logprobs, old_logprobs, advantages, mask),
        num_tokens,
        num_sequences,
        ref_logprobs=ref_logprobs,
        kl_coef=cfg.kl_coef,
        entropy=entropy,
        entropy_coef=cfg.entropy_coef,
        is_weights=weights,
    )
    return loss, {**metrics, **extra}


def _loss_of_kind(
    cfg: LossConfig,
    args: tuple[torch.Tensor, ...],
    num_tokens: float | None,
    num_sequences: float | None,
    **reg: Any,
) -> tuple[torch.Tensor, Metrics]:
    """The loss function ``cfg.kind`` names, with its clip settings, on ``args``."""
    if cfg.kind == "grpo":
        return losses.grpo_loss(*args, cfg.clip_eps, num_tokens=num_tokens, **reg)
    if cfg.kind == "dapo":
        return losses.dapo_loss(
            *args, cfg.clip_eps_low, cfg.clip_eps_high, num_tokens=num_tokens, **reg
        )
    if cfg.kind == "dr_grpo":
        assert cfg.max_response_tokens is not None  # LossConfig refuses dr_grpo without it
        return losses.dr_grpo_loss(
            *args, cfg.clip_eps, cfg.max_response_tokens, num_sequences=num_sequences, **reg
        )
    if cfg.kind == "gspo":
        return losses.gspo_loss(
            *args,
            cfg.gspo_clip_eps_low,
            cfg.gspo_clip_eps_high,
            num_sequences=num_sequences,
            **reg,
        )
    raise AssertionError(f"unhandled loss kind {cfg.kind!r}")  # Literal keeps this unreachable


def shaped_rewards(
    cfg: LossConfig, rewards: torch.Tensor, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """``rewards`` [B] plus, with ``cfg.overlong_buffer``, the DAPO overlong penalty
    of ``lengths`` (response tokens per sample)."""
    if cfg.overlong_buffer is None:
        return rewards
    if lengths is None:
        raise ValueError("train.loss.overlong_buffer needs the response lengths")
    assert cfg.max_response_tokens is not None  # LossConfig requires it with the buffer
    return rewards.float() + overlong_penalty(lengths, cfg.max_response_tokens, cfg.overlong_buffer)


def sample_advantages(
    cfg: LossConfig, rewards: torch.Tensor, n: int, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """Advantages [B*n] of ``rewards`` (``shaped_rewards``) by ``cfg.advantage``, groups
    of ``n`` contiguous samples. gae has none here: the critic computes per-token ones."""
    if cfg.advantage == "gae":
        raise ValueError(
            "train.loss.advantage gae needs the critic's per-token advantages; "
            "pass token_advantages (training.critic computes them)"
        )
    return _ESTIMATORS[cfg.advantage](shaped_rewards(cfg, rewards, lengths), n)


def filter_loss_mask(
    cfg: LossConfig, loss_mask: torch.Tensor, finish_reasons: Sequence[str]
) -> torch.Tensor:
    """``loss_mask`` [B, T] with truncated samples zeroed when ``cfg.overlong_filter``;
    the same tensor otherwise."""
    if not cfg.overlong_filter:
        return loss_mask
    return loss_mask * overlong_keep(finish_reasons).to(loss_mask.dtype).unsqueeze(1)
