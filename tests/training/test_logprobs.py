"""token_stats against hand-computed numbers and against log_softmax over full logits."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from training.logprobs import token_stats

N, H, V = 13, 8, 50


def _reference(hidden, weight, targets, t, entropy_grad=True):
    """log_softmax over the whole [N, V] logits: what token_stats must equal."""
    logp = torch.log_softmax((hidden @ weight.T).float() / t, dim=-1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _inputs(dtype=torch.float32, n=N, h=H, v=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = torch.randn(v, h, generator=g).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


def test_hand_computed_two_token_vocab():
    # Logits [0, ln 3]: p = [1/4, 3/4] at t=1; at t=0.5 they are [0, ln 9], p = [1/10, 9/10].
    hidden = torch.tensor([[0.0, math.log(3.0)]])
    weight = torch.eye(2)
    targets = torch.tensor([1])
    lp, ent = token_stats(hidden, weight, targets, 1.0, with_entropy=True)
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)
    lp, ent = token_stats(hidden, weight, targets, 0.5, with_entropy=True)
    assert lp.item() == pytest.approx(math.log(0.9), abs=1e-6)
    assert ent.item() == pytest.approx(-(0.1 * math.log(0.1) + 0.9 * math.log(0.9)), abs=1e-6)


@pytest.mark.parametrize("t", [0.5, 0.7, 1.0])
@pytest.mark.parametrize("chunk_rows", [1, 4, 5, 13, 1024])
def test_values_match_full_log_softmax(t, chunk_rows):
    hidden, weight, targets = _inputs()
    lp, ent = token_stats(hidden, weight, targets, t, with_entropy=True, chunk_rows=chunk_rows)
    ref_lp, ref_ent = _reference(hidden, weight, targets, t)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (N,)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)


def test_no_entropy_gives_none():
    hidden, weight, targets = _inputs()
    assert token_stats(hidden, weight, targets)[1] is None
    assert token_stats(hidden.requires_grad_(), weight, targets)[1] is None


@pytest.mark.parametrize("t", [0.5, 0.7, 1.0])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_gradients_match_autograd_through_full_logits(t, entropy_grad):
    hidden, weight, targets = _inputs()
    a, b = torch.randn(N), torch.randn(N)  # per-token weights of a loss like PPO's + entropy bonus

    def grads(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = fn(h, w)
        loss = (a * lp).sum() + ((b * ent).sum() if entropy_grad else 0.0)
        loss.backward()
        return h.grad, w.grad, ent

    gh, gw, ent = grads(
        lambda h, w: token_stats(h, w, targets, t, True, entropy_grad, chunk_rows=5)
    )
    rh, rw, _ = grads(lambda h, w: _reference(h, w, targets, t, entropy_grad))
    torch.testing.assert_close(gh, rh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, rw, atol=1e-5, rtol=1e-5)
    assert (ent.grad_fn is not None) == entropy_grad


def test_entropy_only_loss_and_one_input_requiring_grad():
    hidden, weight, targets = _inputs()
    for needs in [(True, False), (False, True)]:
        h, w = hidden.clone().requires_grad_(needs[0]), weight.clone().requires_grad_(needs[1])
        token_stats(h, w, targets, 0.7, True, True, chunk_rows=3)[1].sum().backward()
        rh, rw = hidden.clone().requires_grad_(needs[0]), weight.clone().requires_grad_(needs[1])
        _reference(rh, rw, targets, 0.7)[1].sum().backward()
        for mine, ref in [(h.grad, rh.grad), (w.grad, rw.grad)]:
            assert (mine is None) == (ref is None)
            if ref is not None:
                torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)


def test_tied_weight_gets_both_gradients():
    # Input embedding and lm_head share one tensor: hidden is built from it too.
    _, weight, targets = _inputs()
    ids = torch.randint(0, V, (N,))
    grads = []
    for fn in (token_stats, _reference):
        w = weight.clone().requires_grad_()
        hidden = torch.tanh(w[ids])
        fn(hidden, w, targets, 1.0)[0].sum().backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-5)


def test_no_grad_path_keeps_no_graph():
    hidden, weight, targets = _inputs()
    hidden.requires_grad_()
    with torch.no_grad():
        lp, ent = token_stats(hidden, weight, targets, 0.7, True, True, chunk_rows=4)
    assert lp.grad_fn is None and ent.grad_fn is None
    torch.testing.assert_close(lp, _reference(hidden.detach(), weight, targets, 0.7)[0])


def test_bf16_matches_bf16_reference():
    hidden, weight, targets = _inputs(torch.bfloat16, n=40, h=32, v=300)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = token_stats(h, w, targets, 0.7, True, True, chunk_rows=16)
    (lp.sum() + ent.sum()).backward()
    rh, rw = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_ent = _reference(rh, rw, targets, 0.7)
    (ref_lp.sum() + ref_ent.sum()).backward()
    assert lp.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == torch.bfloat16
    # Same bf16 matmul, then float32: the values agree to float32 rounding.
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=1e-4)
    # Gradients: h.grad is the same bf16 matmul; W.grad differs by about a bf16 ulp,
    # as ours sums the chunks in float32.
    torch.testing.assert_close(h.grad.float(), rh.grad.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(w.grad.float(), rw.grad.float(), atol=1e-2, rtol=1e-2)


class _LargestTensor(TorchDispatchMode):
    """Records the most elements any op produced while active."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, tuple | list) else [out]:
            if isinstance(o, torch.Tensor):
                self.most = max(self.most, o.numel())
        return out


def test_never_holds_n_by_v():
    n, h, v, rows = 64, 4, 1000, 8
    hidden, weight, targets = _inputs(n=n, h=h, v=v)
    hidden.requires_grad_()
    weight.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda x: saved.append(x.numel()) or x, lambda x: x
    ):
        lp, ent = token_stats(hidden, weight, targets, 0.7, True, True, chunk_rows=rows)
    assert saved and max(saved) == v * h  # the weight itself; per-row stats are [N]
    with _LargestTensor() as largest:
        lp, ent = token_stats(hidden, weight, targets, 0.7, True, True, chunk_rows=rows)
        (lp.sum() + ent.sum()).backward()
    assert largest.most == max(rows * v, v * h) < n * v
    # The hooks do see an [N, V] tensor where one is saved.
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(
        lambda x: saved.append(x.numel()) or x, lambda x: x
    ):
        _reference(hidden, weight, targets, 0.7)
    assert max(saved) == n * v


def test_empty_selection():
    _, weight, _ = _inputs()
    hidden = torch.zeros(0, H, requires_grad=True)
    lp, ent = token_stats(hidden, weight, torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert lp.shape == ent.shape == (0,) and lp.dtype == torch.float32
    lp.sum().backward()  # a loss over no tokens still backpropagates
    assert hidden.grad.shape == (0, H)


@pytest.mark.parametrize("t", [0.0, -1.0, float("nan")])
def test_bad_temperature_is_named(t):
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match=f"temperature must be > 0, got {t}"):
        token_stats(hidden, weight, targets, t)


def test_bad_shapes_are_named():
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match=r"hidden \(13, 8\), weight \(50, 7\)"):
        token_stats(hidden, weight[:, :7], targets)
    with pytest.raises(ValueError, match=r"targets \(12,\)"):
        token_stats(hidden, weight, targets[:12])
    with pytest.raises(ValueError, match="chunk_rows must be >= 1, got 0"):
        token_stats(hidden, weight, targets, chunk_rows=0)
    with pytest.raises(ValueError, match="hidden is torch.bfloat16 but weight is torch.float32"):
        token_stats(hidden.bfloat16(), weight, targets)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernel_agrees_with_eager_on_cuda(dtype):
    """The CUDA default (``pick_kernel``) gives eager's values and gradients, in
    chunks of unequal size (the dynamic row count) with and without the entropy."""
    from training.logprobs import pick_kernel

    assert pick_kernel("auto", torch.device("cuda")) == "compiled"
    assert pick_kernel("auto", torch.device("cpu")) == "eager"
    # fp32 as fp32: the trainer's setup turns TF32 on for the whole process, and an
    # earlier test may have run it; this test is about the kernels' own arithmetic.
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        _compare_kernels_on_cuda(dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _compare_kernels_on_cuda(dtype: torch.dtype) -> None:
    hidden, weight, targets = (x.cuda() for x in _inputs(dtype, n=300, h=64, v=5000))
    weights = torch.linspace(0, 1, 300, device="cuda")
    out = {}
    for kernel in ("eager", "compiled"):
        for entropy_grad in (False, True):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            lp, ent = token_stats(h, w, targets, 0.7, True, entropy_grad, 128, kernel)
            loss = (lp * weights).sum() + ((ent * weights).sum() if entropy_grad else 0)
            loss.backward()
            out[kernel, entropy_grad] = [lp, ent, h.grad, w.grad]
    # fp32: the compiled kernel sums in another order (seen: 1.3e-5 at 1 of 300 values)
    tol = 5e-5 if dtype == torch.float32 else 2e-2
    for entropy_grad in (False, True):
        names = ("logprobs", "entropy", "hidden grad", "weight grad")
        for name, a, b in zip(names, out["eager", entropy_grad], out["compiled", entropy_grad]):
            torch.testing.assert_close(
                b.float(),
                a.float(),
                atol=tol,
                rtol=tol,
                msg=lambda m, name=name, eg=entropy_grad: f"{name} (entropy_grad={eg}): {m}",
            )
