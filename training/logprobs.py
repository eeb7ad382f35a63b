"""Token logprobs and entropies from the last hidden states, chunked over rows.

Owns ``token_stats``: for N positions with hidden states ``h`` [N, H], the
output embedding ``W`` [V, H] and temperature ``t``, it gives

    z   = (h @ W.T).float() / t                       logits, [N, V], never whole
    lse = logsumexp(z)                                [N]
    lp  = z[target] - lse                             logprob of the target, [N]
    H   = -sum_i p_i log p_i,  p = exp(z - lse)       entropy, [N]

without ever holding the [N, V] logits. With Qwen's vocabulary of 151,936 and
8k tokens one float32 [N, V] tensor is 5 GB, and log_softmax over full logits
keeps several of them for backward. Here forward and backward each build the
logits of ``chunk_rows`` rows at a time, so the extra memory is
O(chunk_rows * V) plus one float32 [V, H] gradient accumulator.

The custom autograd Function saves only h, W, the targets and the float32
per-row ``lse`` and ``H``; backward recomputes each chunk's logits. With
respect to z, the gradients are (onehot(target) - p) for lp and
-p_i (log p_i + H) for H. Both are divided by t to get the gradient of the raw
matmul output.

The matmul runs in the input dtype, as HF's lm_head would compute it; the
softmax maths runs in float32. This module holds no models, config or
trainer state, and never calls torch.compile or fused kernels.
"""

from __future__ import annotations

import torch


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, t: float) -> torch.Tensor:
    return (h @ weight.t()).float().div_(t)


def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    t: float,
    with_entropy: bool,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row (lp, lse, entropy) in float32; call it with no grad."""
    n = hidden.shape[0]
    lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(lp)
    ent = torch.empty_like(lp) if with_entropy else None
    for s in range(0, n, rows):
        e = min(s + rows, n)
        logp = _chunk_logits(hidden[s:e], weight, t)
        lse[s:e] = torch.logsumexp(logp, dim=-1)
        logp.sub_(lse[s:e, None])  # in place: one [rows, V] float32 buffer, not two
        lp[s:e] = logp.gather(1, targets[s:e, None]).squeeze(1)
        if ent is not None:
            ent[s:e] = -logp.exp().mul_(logp).sum(-1)
    return lp, lse, ent


class _TokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, t, with_entropy, entropy_grad, rows):
        lp, lse, ent = _forward(hidden, weight, targets, t, with_entropy, rows)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.t, ctx.rows = t, rows
        # None grads (not zeros) for the outputs the loss does not read.
        ctx.set_materialize_grads(False)
        if ent is None:
            ent = lp.new_empty(0)
        if not (with_entropy and entropy_grad):
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        if g_lp is None:
            g_lp = torch.zeros_like(lse)
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # float32 sum over chunks, so a bf16 weight's gradient is rounded once
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, hidden.shape[0], ctx.rows):
            e = min(s + ctx.rows, hidden.shape[0])
            h = hidden[s:e]
            logp = _chunk_logits(h, weight, ctx.t).sub_(lse[s:e, None])
            coef = g_lp[s:e, None]
            if g_ent is not None:  # d(lp)/dz + d(H)/dz, weighted by their output grads
                coef = (logp + ent[s:e, None]).mul_(g_ent[s:e, None]).add_(coef)
            dz = logp.exp_().mul_(coef).neg_()  # -p * coef, reusing the logp buffer
            dz.scatter_add_(1, targets[s:e, None], g_lp[s:e, None]).div_(ctx.t)
            dz = dz.to(hidden.dtype)  # autograd casts here too (backward of .float())
            if grad_h is not None:
                grad_h[s:e] = dz @ weight
            if grad_w is not None and dz.dtype == torch.float32:
                grad_w.addmm_(dz.t(), h)  # no [V, H] temporary
            elif grad_w is not None:
                grad_w += dz.t() @ h  # the matmul in bf16/fp16, as autograd's would be
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None, None


def token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_rows: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 logprob of ``targets`` [N] under ``log_softmax(hidden @ weight.T / t)``
    and, with ``with_entropy``, the entropy [N] of that distribution.

    ``hidden`` [N, H] and ``weight`` [V, H] share a dtype. The entropy keeps a
    graph only when ``entropy_grad`` and grad is enabled; the logprob keeps one
    whenever grad is enabled and an input requires grad."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if (
        hidden.dim() != 2
        or weight.dim() != 2
        or hidden.shape[1] != weight.shape[1]
        or targets.shape != hidden.shape[:1]
    ):
        raise ValueError(
            f"need hidden [N, H], weight [V, H] and targets [N]; got hidden "
            f"{tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets {tuple(targets.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden is {hidden.dtype} but weight is {weight.dtype}; cast one to match"
        )
    t = float(temperature)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if not grad:
        with torch.no_grad():
            lp, _, ent = _forward(hidden, weight, targets, t, with_entropy, chunk_rows)
        return lp, ent
    lp, ent = _TokenStats.apply(hidden, weight, targets, t, with_entropy, entropy_grad, chunk_rows)
    return lp, ent if with_entropy else None
