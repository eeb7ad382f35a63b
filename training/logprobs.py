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
softmax maths runs in float32. Two kernels do that maths, chosen by ``kernel``:
``eager`` (ATen ops, about nine passes over each float32 chunk in forward and
backward; the reference, and CPU's) and ``compiled`` (the same formulas through
``torch.compile``: on CUDA each direction is one or two fused kernels that read
the chunk's logits in their matmul dtype and never write a float32 [rows, V]
tensor). They agree to float32 rounding. This module holds no models, config or
trainer state.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal

import torch

Kernel = Literal["eager", "compiled"]


def pick_kernel(setting: str, device: torch.device) -> Kernel:
    """``train.logprob_kernel`` on ``device``: ``auto`` is ``compiled`` on CUDA where
    Triton is installed (torch.compile's GPU code generator), else ``eager``."""
    if setting == "auto":
        cuda = device.type == "cuda" and importlib.util.find_spec("triton") is not None
        return "compiled" if cuda else "eager"
    if setting not in ("eager", "compiled"):
        raise ValueError(f"logprob kernel {setting!r}: choose auto, eager or compiled")
    return setting  # type: ignore[return-value]


def _fused_stats(
    z: torch.Tensor, z_target: torch.Tensor, t: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(lp, lse, entropy) of one chunk's logits ``z`` [rows, V]; H = lse - sum p z."""
    zf = z.float() / t
    m = zf.amax(-1, keepdim=True)
    e = torch.exp(zf - m)
    s = e.sum(-1)
    lse = m.squeeze(-1) + torch.log(s)
    lp = z_target.float() / t - lse
    ent = lse - (e * zf).sum(-1) / s if with_entropy else None
    return lp, lse, ent


def _fused_grad(
    z: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    g_lp: torch.Tensor,
    ent: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    t: float,
) -> torch.Tensor:
    """d(loss)/d(z) of one chunk, in ``z``'s dtype: (onehot(target) - p) g_lp
    - p (log p + H) g_ent, divided by t."""
    logp = z.float() / t - lse[:, None]
    p = torch.exp(logp)
    coef = g_lp[:, None]
    if g_ent is not None:
        coef = coef + g_ent[:, None] * (logp + ent[:, None])
    hit = torch.arange(z.shape[1], device=z.device)[None, :] == targets[:, None]
    dz = (torch.where(hit, g_lp[:, None], 0.0) - p * coef) / t
    return dz.to(z.dtype)


@functools.cache
def _compiled(fn):  # noqa: ANN001, ANN202 - one compiled twin per function, made on first use
    # dynamic: the last chunk's row count differs; one graph serves every count.
    return torch.compile(fn, dynamic=True)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, t: float) -> torch.Tensor:
    return (h @ weight.t()).float().div_(t)


def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    t: float,
    with_entropy: bool,
    rows: int,
    kernel: Kernel,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row (lp, lse, entropy) in float32; call it with no grad."""
    n = hidden.shape[0]
    lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(lp)
    ent = torch.empty_like(lp) if with_entropy else None
    for s in range(0, n, rows):
        e = min(s + rows, n)
        if kernel == "compiled":
            z = hidden[s:e] @ weight.t()
            z_target = z.gather(1, targets[s:e, None]).squeeze(1)
            lp[s:e], lse[s:e], h = _compiled(_fused_stats)(z, z_target, t, with_entropy)
            if ent is not None:
                ent[s:e] = h
            continue
        logp = _chunk_logits(hidden[s:e], weight, t)
        lse[s:e] = torch.logsumexp(logp, dim=-1)
        logp.sub_(lse[s:e, None])  # in place: one [rows, V] float32 buffer, not two
        lp[s:e] = logp.gather(1, targets[s:e, None]).squeeze(1)
        if ent is not None:
            ent[s:e] = -logp.exp().mul_(logp).sum(-1)
    return lp, lse, ent


class _TokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, t, with_entropy, entropy_grad, rows, kernel):
        lp, lse, ent = _forward(hidden, weight, targets, t, with_entropy, rows, kernel)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.t, ctx.rows, ctx.kernel = t, rows, kernel
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
            if ctx.kernel == "compiled":
                dz = _compiled(_fused_grad)(
                    h @ weight.t(),
                    targets[s:e],
                    lse[s:e],
                    g_lp[s:e],
                    None if g_ent is None else ent[s:e],
                    None if g_ent is None else g_ent[s:e],
                    ctx.t,
                )
            else:
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
        return grad_h, grad_w, None, None, None, None, None, None


def token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_rows: int = 1024,
    kernel: Kernel = "eager",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 logprob of ``targets`` [N] under ``log_softmax(hidden @ weight.T / t)``
    and, with ``with_entropy``, the entropy [N] of that distribution.

    ``hidden`` [N, H] and ``weight`` [V, H] share a dtype. The entropy keeps a
    graph only when ``entropy_grad`` and grad is enabled; the logprob keeps one
    whenever grad is enabled and an input requires grad. ``kernel``: ``eager`` or
    ``compiled`` (module doc; ``pick_kernel`` chooses one for a device)."""
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
            lp, _, ent = _forward(hidden, weight, targets, t, with_entropy, chunk_rows, kernel)
        return lp, ent
    lp, ent = _TokenStats.apply(
        hidden, weight, targets, t, with_entropy, entropy_grad, chunk_rows, kernel
    )
    return lp, ent if with_entropy else None
