"""Batched autoregressive decoding with a KV cache, one forward per token.

Owns the decode loop: left-pad the prompts, prefill once, then feed one token
per live row per step through a ``DynamicCache``. Finished rows are dropped
from the batch (and from the cache) so they stop costing compute. Knows
nothing about queues, pausing or versions: the caller's ``between_steps``
hook decides whether to keep going, and ``step_lock`` guards every forward so
weights can be swapped between steps. A row past its ``deadline`` ends with
finish reason abort at the next step. Forwards and cache edits go through a
``ModelRunner`` (one per decode call), so an engine spanning several ranks
(``engines.embedded.tensor_parallel``) mirrors each of them on its other ranks.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from engines.embedded.sampling import sample_rows
from engines.types import FinishReason, GenerateResult, SamplingParams


@dataclass
class Row:
    """Mutable decode state of one request (engine-internal, never on the wire)."""

    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    version_start: str
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    # Returns the stop string the completion now contains, if any (stop strings).
    stop_check: Callable[[list[int]], str | None] | None = None
    deadline: float | None = None  # time.monotonic() after which the row is aborted

    def push(self, tok: int, logprob: float) -> None:
        if self.finish is not None:  # ended from outside (abort_request) during the step
            return
        self.output_ids.append(tok)
        self.logprobs.append(logprob)
        matched = None if self.stop_check is None else self.stop_check(self.output_ids)
        if tok in self.stop_ids:
            self.finish = {"type": "stop", "matched": tok}
        elif matched is not None:
            self.finish = {"type": "stop", "matched": matched}
        elif len(self.output_ids) >= self.params.max_new_tokens:
            self.finish = {"type": "length", "length": self.params.max_new_tokens}

    def result(self, text: str, version_end: str, engine_id: int) -> GenerateResult:
        """The finished row in SGLang's ``/generate`` result shape."""
        assert self.finish is not None, "result() of an unfinished row"
        return {
            "output_ids": self.output_ids,
            "text": text,
            "meta_info": {
                "weight_version": self.version_start,
                "weight_version_end": version_end,
                "finish_reason": self.finish,
                "output_token_logprobs": [
                    [lp, t, None] for lp, t in zip(self.logprobs, self.output_ids)
                ],
                "prompt_tokens": len(self.prompt),
                "completion_tokens": len(self.output_ids),
                "engine_id": engine_id,
            },
        }


def _left_pad(rows: list[Row], pad_id: int, device: torch.device):
    # A retracted row resumes by prefilling its prompt plus what it generated.
    contexts = [r.prompt + r.output_ids for r in rows]
    width = max(map(len, contexts))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, ctx in enumerate(contexts):
        ids[i, width - len(ctx) :] = torch.tensor(ctx, dtype=torch.long)
        mask[i, width - len(ctx) :] = 1
    # Positions count real tokens only, so a row sees the same positions
    # whatever padding its batch needs.
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), pos.to(device)


DEADLINE_MSG = "deadline exceeded: unfinished after engines.request_timeout_s"


class Retract:
    """``between_steps`` returns RETRACT to stop decoding and leave the live rows
    unfinished (their KV cache is dropped; the caller queues them again)."""

    def __repr__(self) -> str:
        return "RETRACT"


RETRACT = Retract()


@functools.cache
def _cache_kwarg(model_cls: type) -> str:
    # transformers 5.x renamed `past_key_values` to `cache`; accept both.
    return (
        "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"
    )


def _forward(model, ids, mask, pos, cache: DynamicCache) -> torch.Tensor:
    """Logits ``[B, V]`` of the last position only (logits_to_keep=1)."""
    kwargs = {_cache_kwarg(type(model)): cache}
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        use_cache=True,
        logits_to_keep=1,
        **kwargs,
    )
    return out.logits[:, -1, :]


class ModelRunner:
    """The forwards of one decode call on one model replica (or on rank 0 of an
    engine whose ``TPRunner`` subclass repeats each call on the other ranks)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache: DynamicCache | None = None

    def begin(self) -> None:
        self.cache = DynamicCache(config=self.model.config)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        assert self.cache is not None, "begin() first"
        return _forward(self.model, ids, mask, pos, self.cache)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` in the cache."""
        assert self.cache is not None, "begin() first"
        self.cache.batch_select_indices(rows)

    def end(self) -> None:
        self.cache = None


@torch.inference_mode()
def decode(
    runner: ModelRunner,
    rows: list[Row],
    pad_id: int,
    device: torch.device,
    between_steps: Callable[[], str | Retract | None] = lambda: None,
    step_lock: contextlib.AbstractContextManager | None = None,
) -> None:
    """Decode ``rows`` in place until each has a finish reason.

    ``between_steps`` runs before every forward after the prefill; it may
    block (pause in place) and returns an abort message to end all live rows
    with finish reason abort, ``RETRACT`` to return with the live rows
    unfinished, or None to go on.
    """
    lock = step_lock if step_lock is not None else contextlib.nullcontext()
    ids, mask, pos = _left_pad(rows, pad_id, device)
    with lock:
        runner.begin()
    try:
        _decode_loop(runner, rows, ids, mask, pos, device, between_steps, lock)
    finally:
        with lock:
            runner.end()


def _decode_loop(runner, rows, ids, mask, pos, device, between_steps, lock) -> None:
    with lock:
        logits = runner.forward(ids, mask, pos)
    live = list(range(len(rows)))  # indices into rows, aligned with the batch dim
    next_pos = pos[:, -1] + 1
    while True:
        # Sampling runs batched on the logits' device; only the B tokens and
        # logprobs come back to the host (one sync per step).
        step_tokens, step_lps = sample_rows(
            logits, [rows[r].params for r in live], [rows[r].generator for r in live]
        )
        now = time.monotonic()
        for r, tok, lp in zip(live, step_tokens, step_lps):
            rows[r].push(tok, lp)
            if rows[r].finish is None and rows[r].deadline is not None and now > rows[r].deadline:
                rows[r].finish = {"type": "abort", "message": DEADLINE_MSG}
        keep = [b for b, r in enumerate(live) if rows[r].finish is None]
        if not keep:
            return
        if len(keep) < len(live):
            sel = torch.tensor(keep, device=device)
            with lock:
                runner.select(sel)
            mask, next_pos = mask[sel], next_pos[sel]
            live = [live[b] for b in keep]
            step_tokens = [step_tokens[b] for b in keep]
        abort = between_steps()
        if abort is RETRACT:
            return
        if abort is not None:
            for r in live:
                rows[r].finish = {"type": "abort", "message": abort}
            return
        tok_t = torch.tensor(step_tokens, dtype=torch.long, device=device)[:, None]
        mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)
        with lock:
            logits = runner.forward(tok_t, mask, next_pos[:, None])
        next_pos = next_pos + 1
