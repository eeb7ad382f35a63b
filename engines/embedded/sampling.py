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

    Each step draws one uniform number per row from it on CPU, whatever device
    the logits are on, so the same seed draws the same way on any device (up
    to float rounding of the cumulative sums).
    """
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def sample_row(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """Draw one token from one row's logits ``[V]``; return (token_id, logprob).
    The same draw as that row gets from ``sample_rows``."""
    tokens, logprobs = sample_rows(logits[None], [params], [generator])
    return tokens[0], logprobs[0]


@torch.no_grad()
def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Draw one token per row of ``logits [B, V]``; return tokens and logprobs.

    The logprob is ``log_softmax(logits / temperature)[token]``: the
    temperature-scaled distribution the token was drawn from. With top-k/top-p
    the draw is from the kept tokens renormalised, but the reported logprob is
    still under the full temperature-scaled distribution, which is what a
    trainer recomputes. With temperature <= 0 (greedy) it is under the
    unscaled distribution (temperature 1).

    The draw is by inverse CDF: one uniform number per row from the row's own
    generator, then a batched ``searchsorted`` on the logits' device. Only B
    tokens and B logprobs leave the device, never the ``[B, V]`` logits, and
    every operation is row-wise, so a row's draw does not depend on its
    neighbours in the batch.
    """
    device = logits.device
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
    logp = torch.log_softmax(logits.float() / temps.to(device)[:, None], dim=-1)
    greedy = torch.tensor([p.temperature <= 0 for p in params], device=device)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    cdf = torch.cumsum(_filtered(logp.exp(), params).double(), dim=-1)
    # u scaled by the row's kept mass: renormalising without dividing every entry.
    target = (u.to(device) * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
    tokens = torch.where(greedy, logits.argmax(-1), idx.squeeze(-1))
    picked = logp.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens.tolist(), picked.tolist()


def _filtered(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``probs`` with all but each row's top-k, then top-p, tokens zeroed (SGLang's
    order), not renormalised. The order of the vocabulary is kept, so a row is
    drawn the same way whether or not its neighbours filter; the sort over the
    vocabulary only runs when some row filters (not the common RL case)."""
    vocab = probs.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [min(p.top_p, 1.0) for p in params]
    if min(top_k) == vocab and min(top_p) == 1.0:
        return probs
    device = probs.device
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)[None, :]
    in_k = rank < torch.tensor(top_k, device=device)[:, None]
    sorted_p = torch.where(in_k, sorted_p, 0.0)
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    # Keep a token while the mass before it is below top_p; the top token is
    # always kept, so no row is ever empty.
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    in_p = before < torch.tensor(top_p, device=device, dtype=before.dtype)[:, None]
    no_filter = torch.tensor([k == vocab and p == 1.0 for k, p in zip(top_k, top_p)], device=device)
    keep_sorted = (in_k & in_p) | no_filter[:, None]
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return torch.where(keep, probs, 0.0)
