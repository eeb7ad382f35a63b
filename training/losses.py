"""Policy losses: GRPO, DAPO and Dr. GRPO (token-level PPO-clip) and GSPO (sequence-level).

Owns the loss maths only: pure functions over tensors. Never touches models,
optimizers, storage, config or Ray (``training.algorithm`` maps the config onto
these). Token tensors are [B, T] (``mask`` 1 on response tokens), ``advantages``
is [B]: every loss here broadcasts one advantage per sequence, as GRPO does.
What all of them leave out: no dual-clip. The correction between the engine's
and the trainer's logprobs is ``training.correction``'s: its detached
``is_weights`` [B, T] scale each token's policy-gradient term (None: no
scaling, the same numbers as before). ``value_loss`` is the critic's (PPO).
"""

from __future__ import annotations

import torch

# A loss's metrics: detached 0-d tensors on the loss's device (or plain floats), read
# on the host once per step by the caller; a float() here would stall the device
# queue at every micro-batch.
Metrics = dict[str, torch.Tensor | float]


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - lp) - (ref - lp) - 1 (>= 0)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def _regularise(
    per_token: torch.Tensor,
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    count: torch.Tensor,
    metrics: Metrics,
    ref_logprobs: torch.Tensor | None,
    kl_coef: float,
    entropy: torch.Tensor | None,
    entropy_coef: float,
) -> torch.Tensor:
    """Add the k3 KL penalty and subtract the entropy bonus per token; log both."""
    if ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs)
        metrics["kl"] = (kl.detach() * mask).sum() / count
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl
    if entropy is not None:
        metrics["entropy"] = (entropy.detach() * mask).sum() / count
        if entropy_coef > 0:
            per_token = per_token - entropy_coef * entropy
    return per_token


def _token_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    denom: float | None,
    ref_logprobs: torch.Tensor | None,
    kl_coef: float,
    entropy: torch.Tensor | None,
    entropy_coef: float,
    is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, Metrics]:
    """Sum over masked tokens of the PPO-clip term (ratio clipped to
    [1 - clip_low, 1 + clip_high]), times ``is_weights`` when given, divided by
    ``denom`` (default: masked tokens)."""
    mask = mask.to(logprobs.dtype)
    count = mask.sum().clamp(min=1.0)
    denom_t = count if denom is None else torch.as_tensor(float(denom))
    adv = advantages.to(logprobs.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv  # [B] per sequence or [B, T] per token

    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    metrics = {
        "pg_loss": (per_token.detach() * mask).sum() / count,
        "clip_frac": (((clipped > unclipped).to(mask.dtype) * mask).sum() / count).detach(),
    }
    per_token = _regularise(
        per_token, logprobs, mask, count, metrics, ref_logprobs, kl_coef, entropy, entropy_coef
    )
    return (per_token * mask).sum() / denom_t, metrics


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    num_tokens: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GRPO (Shao et al. 2024, DeepSeekMath) PPO-clip loss with a symmetric ``clip_eps``.

    Unlike the paper's per-sequence mean (1/|o_i|), it aggregates at token level
    (as DAPO does): the sum of per-token terms over masked tokens divided by
    ``num_tokens``, which defaults to the masked token count. Callers that split
    a batch into micro-batches or ranks pass the global token count so the
    summed gradients equal the whole-batch mean. KL is the k3 estimator, as in
    the paper, but only when ``kl_coef`` > 0.

    Metrics are means over this call's masked tokens: ``pg_loss``, ``clip_frac``
    (tokens where the clipped branch is the active one), ``kl`` (k3, when
    ``ref_logprobs`` is given) and ``entropy`` (when given).
    """
    reg = (ref_logprobs, kl_coef, entropy, entropy_coef)
    return _token_clip_loss(
        logprobs, old_logprobs, advantages, mask, clip_eps, clip_eps, num_tokens, *reg, is_weights
    )


def dapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    num_tokens: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """DAPO (Yu et al. 2025) loss: decoupled clip ("clip-higher"), token-level mean.

    The ratio is clipped to [1 - clip_eps_low, 1 + clip_eps_high] (the paper:
    0.2 / 0.28) and terms are summed over tokens and divided by ``num_tokens``
    as in ``grpo_loss``, so equal eps give exactly ``grpo_loss``. The paper
    drops the KL term; it is kept here only when ``kl_coef`` > 0. Dynamic
    sampling belongs to the rollout, and the overlong penalty and filter to
    ``training.shaping``; neither is part of this function.
    """
    reg = (ref_logprobs, kl_coef, entropy, entropy_coef)
    return _token_clip_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_eps_low,
        clip_eps_high,
        num_tokens,
        *reg,
        is_weights,
    )


def dr_grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    max_tokens: int,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    num_sequences: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") loss.

    PPO-clip per token, summed over each sequence's tokens and divided by the
    constant generation budget ``max_tokens`` instead of the sequence's length,
    then averaged over ``num_sequences`` (default: rows here; callers that split
    a batch pass the global count). The loss is sum / (num_sequences *
    max_tokens), so a long wrong answer is not penalised less per token than a
    short one. The other half of Dr. GRPO, no std normalisation, is the
    ``dr_grpo`` advantage estimator, not this function.
    """
    rows = logprobs.shape[0] if num_sequences is None else num_sequences
    denom = float(rows) * max_tokens
    reg = (ref_logprobs, kl_coef, entropy, entropy_coef)
    return _token_clip_loss(
        logprobs, old_logprobs, advantages, mask, clip_eps, clip_eps, denom, *reg, is_weights
    )


def sequence_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """GSPO's importance ratio per sequence [B]: exp(mean over masked tokens of
    (lp - old)), i.e. the geometric mean of the token ratios. 1 for an empty row."""
    mask = mask.to(logprobs.dtype)
    lengths = mask.sum(dim=1).clamp(min=1.0)
    return torch.exp(((logprobs - old_logprobs) * mask).sum(dim=1) / lengths)


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    num_sequences: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization") loss.

    One ratio per sequence, s_i = ``sequence_ratio`` (length-normalised), clipped
    to [1 - clip_eps_low, 1 + clip_eps_high] (the paper: 3e-4 / 4e-4), and the
    sequence term max(-A s, -A clip(s)) averaged over ``num_sequences`` (default:
    rows here). The paper has no KL or entropy term; when their coefficients are
    set they are added as each sequence's token mean, so every sequence still
    weighs the same. Rows without response tokens contribute nothing. This is
    plain GSPO, not the GSPO-token variant with per-token advantages.

    Metrics are token-weighted (each token carries its sequence's value), so the
    trainer can sum them with the token losses' metrics: ``pg_loss``,
    ``clip_frac`` (share of tokens whose sequence ratio was clipped), ``kl``,
    ``entropy``.
    """
    mask = mask.to(logprobs.dtype)
    lengths = mask.sum(dim=1)
    has_tokens = (lengths > 0).to(mask.dtype)
    count = lengths.sum().clamp(min=1.0)
    rows = logprobs.shape[0] if num_sequences is None else num_sequences
    adv = advantages.to(logprobs.dtype)

    ratio = sequence_ratio(logprobs, old_logprobs, mask)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_seq = torch.maximum(unclipped, clipped) * has_tokens
    if is_weights is not None:
        # A row's token mean: the sequence weight itself for the sequence-level
        # corrections, the only ones LossConfig allows with gspo.
        per_seq = per_seq * (is_weights.detach() * mask).sum(dim=1) / lengths.clamp(min=1.0)
    metrics = {
        "pg_loss": (per_seq.detach() * lengths).sum() / count,
        "clip_frac": (((clipped > unclipped).to(mask.dtype) * lengths).sum() / count).detach(),
    }
    # The regularisers are token terms; zero start so only they are summed per row.
    zero = torch.zeros_like(logprobs)
    reg = _regularise(
        zero, logprobs, mask, count, metrics, ref_logprobs, kl_coef, entropy, entropy_coef
    )
    per_seq = per_seq + (reg * mask).sum(dim=1) / lengths.clamp(min=1.0)
    return per_seq.sum() / float(rows), metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float | None,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO's clipped value loss (Schulman et al. 2017, as in OpenAI baselines' ppo2):
    0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2) per token,
    summed over masked tokens and divided by ``num_tokens`` (default: masked tokens).
    ``clip_eps`` None is the plain squared error. Metrics: ``vf_loss`` and
    ``vf_clip_frac`` (tokens where the clipped branch is the active one)."""
    mask = mask.to(values.dtype)
    count = mask.sum().clamp(min=1.0)
    denom = count if num_tokens is None else torch.as_tensor(float(num_tokens))
    unclipped = (values - returns) ** 2
    per_token, clipped_active = unclipped, torch.zeros_like(mask)
    if clip_eps is not None:
        clipped_v = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
        clipped = (clipped_v - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_active = (clipped > unclipped).to(mask.dtype)
    per_token = 0.5 * per_token
    metrics = {
        "vf_loss": (per_token.detach() * mask).sum() / count,
        "vf_clip_frac": ((clipped_active * mask).sum() / count).detach(),
    }
    return (per_token * mask).sum() / denom, metrics
