"""Wire types of the engine API.

Results keep SGLang's JSON shapes (plain dicts, described here as TypedDicts),
so the embedded engine, an SGLang server and the HTTP client are
interchangeable. Requests are parsed once into frozen dataclasses, so bad
sampling settings fail at the call and not mid-decode. This module holds
shapes only: no torch, no ray.

The ``*Body`` models are the JSON bodies of the HTTP API, field for field as
SGLang 0.5.x's ``io_struct`` request classes for what RL callers send. They
are strict: an unknown field or a wrong type is a 400, never ignored.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PauseMode = Literal["abort", "in_place", "retract"]
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed


@dataclass(frozen=True)
class AdapterServing:
    """What an engine must be able to serve when every version after v0 is a LoRA
    adapter (``train.lora``): an SGLang server is launched with these limits."""

    max_rank: int  # --max-lora-rank: the adapters' rank
    target_modules: tuple[str, ...]  # --lora-target-modules: the modules they change
    max_loaded: int  # --max-loaded-loras: versions kept at once (staleness + 2)


class EngineDeadError(RuntimeError):
    """The engine's decode loop has died; the engine must be restarted. Raised in an
    embedded engine's actor, caught by the driver's dispatch (``engines.dispatch``)."""


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (SGLang's `sampling_params` keys)."""

    temperature: float = 1.0  # <= 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    max_new_tokens: int = 16  # hard cap on completion tokens
    sampling_seed: int = 0  # seeds this row's own torch.Generator
    stop_token_ids: tuple[int, ...] | None = None  # None = the tokenizer's eos
    top_k: int = -1  # keep the k most likely tokens; -1 = all (SGLang's "off")
    stop: tuple[str, ...] | None = None  # stop strings, matched on the decoded completion

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Parse SGLang-style keys; unknown keys are refused, not ignored."""
        unknown = set(d) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(
                f"unsupported sampling_params keys {sorted(unknown)}; "
                "use temperature, top_p, top_k, max_new_tokens, sampling_seed, "
                "stop_token_ids, stop"
            )
        stop = d.get("stop_token_ids")
        stop_strs = d.get("stop")
        if isinstance(stop_strs, str):
            stop_strs = [stop_strs]
        p = cls(
            temperature=float(d.get("temperature", 1.0)),
            top_p=float(d.get("top_p", 1.0)),
            max_new_tokens=int(d.get("max_new_tokens", 16)),
            sampling_seed=int(d.get("sampling_seed", 0)),
            stop_token_ids=None if stop is None else tuple(int(t) for t in stop),
            top_k=int(d.get("top_k", -1)),
            stop=tuple(str(x) for x in stop_strs) if stop_strs else None,
        )
        if p.top_k == 0 or p.top_k < -1:
            raise ValueError(f"top_k={p.top_k}: set top_k to -1 (off) or >= 1")
        if not 0.0 < p.top_p <= 1.0:
            raise ValueError(f"top_p={p.top_p}: set top_p in (0, 1]")
        if p.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={p.max_new_tokens}: set max_new_tokens >= 1")
        if not 0 <= p.sampling_seed <= MAX_SEED:
            raise ValueError(f"sampling_seed={p.sampling_seed}: set sampling_seed in [0, 2**63-1]")
        if not math.isfinite(p.temperature):
            raise ValueError(f"temperature={p.temperature}: set a finite temperature >= 0")
        return p


@dataclass(frozen=True)
class RequestLimits:
    """What one engine's model accepts; ``check`` refuses a row before it is queued."""

    vocab_size: int  # token ids must lie in [0, vocab_size)
    context_length: int  # prompt + max_new_tokens must not exceed it

    def check(self, prompt: list[Any], p: SamplingParams) -> list[int]:
        """The prompt as a list of ints; ValueError naming the bound it breaks."""
        try:
            ids = [operator.index(t) for t in prompt]
        except TypeError:
            raise ValueError("input_ids must be lists of integer token ids") from None
        if not ids:
            raise ValueError("empty prompt: every input_ids row needs >= 1 token")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size}): "
                "send ids the model's tokenizer produced"
            )
        total = len(ids) + p.max_new_tokens
        if total > self.context_length:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_new_tokens={p.max_new_tokens} = {total} "
                f"exceeds the context length {self.context_length}: shorten the prompt or "
                "lower max_new_tokens (or raise engines.context_length)"
            )
        return ids


class FinishReason(TypedDict, total=False):
    type: Literal["stop", "length", "abort"]
    matched: int | str  # stop: the stop token id (or stop string) that ended the request
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


# ---- HTTP request bodies (SGLang io_struct names in comments) ---------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    rid: str | None = None  # BaseReq.rid: SGLang accepts one on every request


class SamplingParamsBody(BaseModel):
    """SGLang ``sampling_params`` keys the embedded engine honours (defaults as SGLang's)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: float = Field(1.0, ge=0)  # 0 = greedy
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1  # -1 = off
    max_new_tokens: int = Field(128, ge=0)
    stop: str | list[str] | None = None  # stop strings; trimmed from ``text``
    stop_token_ids: list[int] | None = None  # added to the eos ids
    ignore_eos: bool = False  # ignore eos and stop_token_ids
    n: int = Field(1, ge=1, le=1024)  # samples of this prompt (bounded: n rows are built)
    sampling_seed: int | None = None  # None = a fresh random seed per sample

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return v


class GenerateBody(_Body):
    """``GenerateReqInput``: one prompt (str / list[int]) or a batch (list of them)."""

    rid: str | list[str] | None = None
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None  # accepted; only output logprobs return
    return_text_in_logprobs: bool = False  # accepted; logprob entries carry None as text
    stream: bool = False
    lora_path: str | list[str | None] | None = None  # the adapter each prompt samples from

    @model_validator(mode="after")
    def _one_input(self) -> GenerateBody:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        if self.stream:
            raise ValueError("stream=true is not supported by the embedded engine")
        return self


class UpdateWeightsFromDiskBody(_Body):
    """``UpdateWeightFromDiskReqInput``."""

    model_path: str
    load_format: str | None = None  # accepted; safetensors dirs only
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False  # accepted; updates are always synchronous here
    torch_empty_cache: bool = False
    keep_pause: bool = False  # accepted; an update never pauses this engine itself
    recapture_cuda_graph: bool = False  # accepted; no CUDA graphs here
    token_step: int = 0  # accepted; not recorded


class LoadLoRAAdapterBody(_Body):
    """``LoadLoRAAdapterReqInput``: serve the peft folder ``lora_path`` as ``lora_name``."""

    lora_name: str
    lora_path: str
    pinned: bool = False  # accepted; the embedded engine holds one adapter, never evicted


class UnloadLoRAAdapterBody(_Body):
    """``UnloadLoRAAdapterReqInput``."""

    lora_name: str


class UpdateWeightVersionBody(_Body):
    """``UpdateWeightVersionReqInput`` (SGLang defaults abort_all_requests to True)."""

    new_version: str
    abort_all_requests: bool = True


class PauseGenerationBody(_Body):
    """``PauseGenerationReqInput``."""

    mode: PauseMode = "abort"


class ContinueGenerationBody(_Body):
    """``ContinueGenerationReqInput``."""

    torch_empty_cache: bool = True


class AbortRequestBody(_Body):
    """``AbortReq``: one request by rid, or all."""

    rid: str = ""
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None  # accepted; the reason is always abort
    abort_message: str | None = None


class MemoryOccupationBody(_Body):
    """``Release/ResumeMemoryOccupationReqInput``; None = every tag."""

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None


class WeightUpdateSessionBody(_Body):
    """The (empty) body of ``/begin_weight_update`` and ``/end_weight_update``."""


class UpdateWeightsFromTensorBody(_Body):
    """``UpdateWeightsFromTensorReqInput``: each entry is base64 of a pickled bucket
    handle (``training.weight_sender``), as SGLang's MultiprocessingSerializer
    with ``output_str=True``. Admin-only: the server unpickles it."""

    serialized_named_tensors: list[str]
    load_format: str | None = "flattened_bucket"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class InitWeightsUpdateGroupBody(_Body):
    """``InitWeightsUpdateGroupReqInput``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedBody(_Body):
    """``UpdateWeightsFromDistributedReqInput``: one bucket's metadata; the tensors
    come by broadcast over ``group_name``."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class DestroyWeightsUpdateGroupBody(_Body):
    """``DestroyWeightsUpdateGroupReqInput``."""

    group_name: str = "weight_update_group"
