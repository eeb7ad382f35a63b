"""GRPO policy loss: PPO-clip at token level, optional k3 KL and entropy bonus.

Owns the loss maths only: pure functions over tensors. Never touches models,
optimizers, storage or Ray. What it leaves out: no critic, no sequence-level
(GSPO) ratio, no dual-clip.
"""

from __future__ import annotations

import torch


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - lp) - (ref - lp) - 1 (>= 0)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


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
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip loss over tokens; all token tensors are [B, T], ``advantages`` is [B].

    Normalisation: token-level (DAPO-style) — the sum of per-token terms over
    masked tokens divided by ``num_tokens``, which defaults to the masked token
    count here. Callers that split a batch into micro-batches or ranks pass the
    global token count so the summed gradients equal the whole-batch mean.

    Metrics are means over this call's masked tokens: ``pg_loss``, ``clip_frac``
    (tokens where the clipped branch is the active one), ``kl`` (k3, when
    ``ref_logprobs`` is given) and ``entropy`` (when given).
    """
    mask = mask.to(logprobs.dtype)
    count = mask.sum().clamp(min=1.0)
    denom = count if num_tokens is None else torch.as_tensor(float(num_tokens))
    adv = advantages.to(logprobs.dtype).unsqueeze(1)

    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(unclipped, clipped)
    metrics = {
        "pg_loss": float((per_token.detach() * mask).sum() / count),
        "clip_frac": float(((clipped > unclipped).to(mask.dtype) * mask).sum() / count),
    }
    if ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs)
        metrics["kl"] = float((kl.detach() * mask).sum() / count)
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl
    if entropy is not None:
        metrics["entropy"] = float((entropy.detach() * mask).sum() / count)
        if entropy_coef > 0:
            per_token = per_token - entropy_coef * entropy
    loss = (per_token * mask).sum() / denom
    return loss, metrics
