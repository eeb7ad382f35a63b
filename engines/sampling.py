"""Per-row token sampling for the embedded engine.

Owns how one row's next token and its logprob are drawn from that row's
logits. Each row draws from its own ``torch.Generator`` and nothing here looks
at other rows, which is what makes a request's tokens independent of the
batch it happens to share. Never mutates the logits it is given.
"""

from __future__ import annotations

import torch

from engines.types import SamplingParams


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator owned by one request, seeded only by its sampling_seed.

    Sampling always runs on CPU (the decode loop copies each step's logits
    to host), so the same seed draws the same way on any device.
    """
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def sample_row(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """Draw one token from one row's logits ``[V]``; return (token_id, logprob).

    The logprob is ``log_softmax(logits / temperature)[token]``: the
    temperature-scaled distribution the token was drawn from. With top_p < 1
    the draw is from the nucleus renormalised, but the reported logprob is
    still under the full temperature-scaled distribution, which is what a
    trainer recomputes. With temperature <= 0 (greedy) it is under the
    unscaled distribution (temperature 1).
    """
    logits = logits.float()
    if params.temperature <= 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = int(torch.argmax(logits))
        return tok, float(logp[tok])
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = logp.exp()
    if params.top_k > 0:
        probs = _top_k(probs, params.top_k)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    tok = int(torch.multinomial(probs, 1, generator=generator))
    return tok, float(logp[tok])


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """``sample_row`` for every row of ``logits [B, V]`` at once; same draws and logprobs.

    The softmax runs once over the batch (row-wise, so a row's values do not
    depend on its neighbours); only the draw itself is per row, from the
    row's own generator.
    """
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
    logp = torch.log_softmax(logits.float() / temps[:, None], dim=-1)
    probs = logp.exp()
    tokens = []
    for b, (p, g) in enumerate(zip(params, generators)):
        if p.temperature <= 0:
            tokens.append(int(torch.argmax(logits[b])))
            continue
        row = _top_k(probs[b], p.top_k) if p.top_k > 0 else probs[b]
        row = _nucleus(row, p.top_p) if p.top_p < 1.0 else row
        tokens.append(int(torch.multinomial(row, 1, generator=g)))
    picked = logp[torch.arange(len(tokens)), torch.tensor(tokens)]
    return tokens, picked.tolist()


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of top tokens whose mass reaches top_p."""
    sorted_p, order = torch.sort(probs, descending=True)
    # Keep a token if the mass before it is still below top_p; the top token
    # is always kept, so the result is never empty.
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return kept / kept.sum()


def _top_k(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Zero all but the k most likely tokens, renormalised (SGLang applies top-k before top-p)."""
    if k >= probs.shape[-1]:
        return probs
    kth = torch.topk(probs, k).values[-1]
    kept = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    return kept / kept.sum()
