"""Per-row sampling: batched and single-row paths agree; logprob definition."""

from __future__ import annotations

import pytest
import torch

from engines.embedded.sampling import make_generator, sample_row, sample_rows
from engines.types import SamplingParams

PARAMS = [
    SamplingParams(temperature=1.0, sampling_seed=1),
    SamplingParams(temperature=0.7, top_p=0.9, sampling_seed=2),
    SamplingParams(temperature=0.0, sampling_seed=3),  # greedy
    SamplingParams(temperature=1.3, top_p=1e-6, sampling_seed=4),  # nucleus of one
]


def test_batched_equals_single_rows():
    logits = torch.randn(len(PARAMS), 30, generator=torch.Generator().manual_seed(0))
    gens_a = [make_generator(p.sampling_seed) for p in PARAMS]
    gens_b = [make_generator(p.sampling_seed) for p in PARAMS]
    for _ in range(20):
        toks, lps = sample_rows(logits, PARAMS, gens_a)
        single = [sample_row(logits[b], p, gens_b[b]) for b, p in enumerate(PARAMS)]
        assert toks == [t for t, _ in single]
        assert lps == pytest.approx([lp for _, lp in single], abs=1e-6)
        # Logprob under the temperature-scaled full distribution (T=1 for greedy).
        for b, p in enumerate(PARAMS):
            t = p.temperature if p.temperature > 0 else 1.0
            ref = torch.log_softmax(logits[b] / t, -1)[toks[b]]
            assert lps[b] == pytest.approx(float(ref), abs=1e-6)
        assert toks[2] == int(torch.argmax(logits[2]))
        assert toks[3] == int(torch.argmax(logits[3]))


def test_draws_follow_the_filtered_distribution():
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = probs.log()[None].repeat(4000, 1)
    cases = {
        "full": (SamplingParams(temperature=1.0), probs),
        "top_k=2": (SamplingParams(temperature=1.0, top_k=2), torch.tensor([0, 4, 0, 3, 0]) / 7),
        "top_p=0.6": (
            SamplingParams(temperature=1.0, top_p=0.6),
            torch.tensor([0, 4, 0, 3, 0]) / 7,
        ),
    }
    for name, (p, want) in cases.items():
        gens = [make_generator(i) for i in range(len(logits))]
        toks, _ = sample_rows(logits, [p] * len(logits), gens)
        freq = torch.bincount(torch.tensor(toks), minlength=5).float() / len(toks)
        assert torch.allclose(freq, want, atol=0.03), (name, freq, want)
