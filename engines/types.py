"""Wire types of the engine API.

Results keep SGLang's JSON shapes (plain dicts, described here as TypedDicts),
so the embedded engine, an SGLang server and the HTTP client are
interchangeable. Requests are parsed once into frozen dataclasses, so bad
sampling settings fail at the call and not mid-decode. This module holds
shapes only: no torch, no ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypedDict

PauseMode = Literal["abort", "in_place", "retract"]


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (SGLang's `sampling_params` keys)."""

    temperature: float = 1.0  # <= 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    max_new_tokens: int = 16  # hard cap on completion tokens
    sampling_seed: int = 0  # seeds this row's own torch.Generator
    stop_token_ids: tuple[int, ...] | None = None  # None = the tokenizer's eos

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Parse SGLang-style keys; unknown keys are refused, not ignored."""
        unknown = set(d) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(
                f"unsupported sampling_params keys {sorted(unknown)}; "
                "use temperature, top_p, max_new_tokens, sampling_seed, stop_token_ids"
            )
        stop = d.get("stop_token_ids")
        p = cls(
            temperature=float(d.get("temperature", 1.0)),
            top_p=float(d.get("top_p", 1.0)),
            max_new_tokens=int(d.get("max_new_tokens", 16)),
            sampling_seed=int(d.get("sampling_seed", 0)),
            stop_token_ids=None if stop is None else tuple(int(t) for t in stop),
        )
        if not 0.0 < p.top_p <= 1.0:
            raise ValueError(f"top_p={p.top_p}: set top_p in (0, 1]")
        if p.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={p.max_new_tokens}: set max_new_tokens >= 1")
        return p


class FinishReason(TypedDict, total=False):
    type: Literal["stop", "length", "abort"]
    matched: int  # stop: the stop token id that ended the request
    length: int  # length: the max_new_tokens that was hit
    message: str  # abort: why


class MetaInfo(TypedDict):
    weight_version: str  # version of the weights when the request started
    weight_version_end: str  # version when it ended; differs only if updated mid-request
    finish_reason: FinishReason
    output_token_logprobs: list[list[Any]]  # [[logprob, token_id, None], ...] per output token
    prompt_tokens: int
    completion_tokens: int
    engine_id: int  # which engine served it (not in SGLang; for balancing and debugging)


class GenerateResult(TypedDict):
    output_ids: list[int]  # completion only, including a matched stop token
    text: str  # decoded completion, special tokens skipped
    meta_info: MetaInfo


class UpdateWeightsResult(TypedDict):
    success: bool
    message: str
    num_paused_requests: int  # requests paused in place when the weights changed
