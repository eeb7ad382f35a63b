"""SGLang ``/generate`` bodies in, embedded-engine calls out, SGLang replies back.

Owns the translation between SGLang's request conventions and the engine's
batch call: single vs batch prompts, ``text`` vs ``input_ids``, parallel
sampling (``n``), per-prompt ``return_logprob`` and ``rid``, and SGLang's stop
semantics (``stop_token_ids`` add to eos; ``ignore_eos`` drops both). All rows
of one request go to the engine as one call, so they are batched together.
Never touches HTTP; ``engines.embedded.http_server`` turns its ValueErrors into 400s.

Reply order with ``n > 1`` is prompt-major: the n samples of prompt 0, then
prompt 1, ... A given ``sampling_seed`` seeds sample j with ``seed + j`` (so
the n samples differ); without one each sample draws a fresh random seed.
"""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from engines.types import GenerateBody, GenerateResult, SamplingParamsBody


class Generator(Protocol):
    def generate(
        self,
        input_ids: list[list[int]],
        sampling_params: list[dict],
        return_logprob: bool,
        rid: list[str],
        lora_path: str | None = None,
    ) -> list[GenerateResult]: ...

    def tokenize(self, texts: list[str]) -> list[list[int]]: ...

    def eos_token_ids(self) -> list[int]: ...

    def get_weight_version(self) -> str: ...


@dataclass
class Plan:
    """One engine row per (prompt, sample), in reply order."""

    single: bool  # one prompt with n == 1: the reply is a dict, not a list
    prompts: list[list[int]] = field(default_factory=list)  # token ids per row
    params: list[dict[str, Any]] = field(default_factory=list)  # engine sampling dict per row
    rids: list[str] = field(default_factory=list)
    logprob: list[bool] = field(default_factory=list)
    lora_path: str | None = None  # the one adapter every row names (None: none named)


def _per_prompt(value: Any, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(
                f"{name} has {len(value)} entries for {n} prompts: give one per prompt"
            )
        return value
    return [value] * n


def _prompts(body: GenerateBody, engine: Generator) -> tuple[list[list[int]], bool]:
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        return engine.tokenize(texts), isinstance(body.text, str)
    ids = body.input_ids
    single = not ids or isinstance(ids[0], int)
    return ([ids] if single else ids), single  # type: ignore[list-item]


def _engine_params(sp: SamplingParamsBody, eos: list[int], seed: int) -> dict[str, Any]:
    stop_ids = [] if sp.ignore_eos else sorted(set(eos) | set(sp.stop_token_ids or []))
    stop = [sp.stop] if isinstance(sp.stop, str) else sp.stop
    return {
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "max_new_tokens": sp.max_new_tokens,
        "sampling_seed": seed,
        "stop_token_ids": stop_ids,
        "stop": stop or None,
    }


def plan(body: GenerateBody, engine: Generator) -> Plan:
    """Expand a request into engine rows; ValueError for a malformed one."""
    prompts, single = _prompts(body, engine)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token")
    b = len(prompts)
    params = _per_prompt(body.sampling_params or SamplingParamsBody(), b, "sampling_params")
    logprob = _per_prompt(
        bool(body.return_logprob)
        if not isinstance(body.return_logprob, list)
        else body.return_logprob,
        b,
        "return_logprob",
    )
    if body.rid is None:
        rids = [uuid.uuid4().hex for _ in range(b)]
    elif isinstance(body.rid, str):
        rids = [body.rid] if b == 1 else [f"{body.rid}_{i}" for i in range(b)]
    else:
        rids = _per_prompt(body.rid, b, "rid")
    named = {body.lora_path} if not isinstance(body.lora_path, list) else set(body.lora_path)
    if len(named) > 1:
        raise ValueError(
            f"lora_path names {sorted(map(str, named))}: this engine serves one adapter at a "
            "time, so every prompt of a request must name the same one"
        )
    out = Plan(single=single and params[0].n == 1, lora_path=next(iter(named), None))
    eos = engine.eos_token_ids()
    for prompt, sp, rid, lp in zip(prompts, params, rids, logprob):
        for j in range(sp.n):
            seed = sp.sampling_seed + j if sp.sampling_seed is not None else secrets.randbits(62)
            out.prompts.append(list(prompt))
            out.params.append(_engine_params(sp, eos, seed))
            out.rids.append(rid if sp.n == 1 else f"{rid}_{j}")
            out.logprob.append(bool(lp))
    return out


def _empty_result(prompt: list[int], version: str) -> GenerateResult:
    """max_new_tokens=0: SGLang answers at once with an empty completion."""
    return {
        "output_ids": [],
        "text": "",
        "meta_info": {
            "weight_version": version,
            "weight_version_end": version,
            "finish_reason": {"type": "length", "length": 0},
            "output_token_logprobs": [],
            "prompt_tokens": len(prompt),
            "completion_tokens": 0,
            "engine_id": -1,
        },
    }


def generate(body: GenerateBody, engine: Generator) -> dict | list[dict]:
    """Run one SGLang ``/generate`` request on the engine; the reply in SGLang's shape."""
    t0 = time.monotonic()
    p = plan(body, engine)
    run = [k for k, sp in enumerate(p.params) if sp["max_new_tokens"] > 0]
    results: list[Any] = [None] * len(p.prompts)
    if run:
        got = engine.generate(
            [p.prompts[k] for k in run],
            [p.params[k] for k in run],
            True,
            [p.rids[k] for k in run],
            p.lora_path,
        )
        for k, r in zip(run, got):
            results[k] = r
    version = engine.get_weight_version()
    latency = time.monotonic() - t0
    replies = []
    for k, r in enumerate(results):
        r = r if r is not None else _empty_result(p.prompts[k], version)
        meta = dict(r["meta_info"], id=p.rids[k], cached_tokens=0, e2e_latency=latency)
        if not p.logprob[k]:
            meta.pop("output_token_logprobs", None)
        replies.append({"text": r["text"], "output_ids": r["output_ids"], "meta_info": meta})
    return replies[0] if p.single else replies
