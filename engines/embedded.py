"""The embedded rollout engine: torch + transformers behind SGLang's control API.

Owns one model replica, its request queue and its pause/version state. Method
names and result shapes follow SGLang's HTTP endpoints (``/generate``,
``/update_weights_from_disk``, ``/pause_generation`` ...), so callers cannot
tell it from an SGLang server. It is a plain class; ``engines.group`` wraps it
as a threaded Ray actor (see ``actor_class``). It never imports prefect and
never reads storage other than the local HF directory it is pointed at.

Threads: ``generate`` calls (up to ``GENERATE_CONCURRENCY`` at once) only
enqueue requests and wait. One decode worker thread drains the queue into
batches of up to ``max_batch_size`` rows, so requests from concurrent calls
share forwards. Control methods run in their own concurrency group, so pause,
continue and reload are served while every generate thread is busy.

Versions and pausing:
- ``meta_info.weight_version`` is the version when the request *started*;
  ``weight_version_end`` the version when it ended.
- ``pause_generation("abort")`` ends in-flight and queued requests with
  finish reason abort (their tokens so far are returned) and returns once the
  worker is idle.
- ``pause_generation("in_place")`` parks the worker between two decode steps,
  keeping every request's KV cache; it returns once the worker is parked.
- ``pause_generation("retract")`` stops the running requests at the next
  step boundary, drops their KV cache and puts them back at the head of the
  queue with the tokens they have; after ``continue_generation`` they are
  prefilled again (prompt + tokens so far) and go on with the same sampling
  generator, so an unchanged model gives the same tokens as no pause did.
  After a weight update they go on under the new weights, KV recomputed.
- A weight update while parked in place is applied at once; the parked
  requests then continue on the *new* weights with their old KV cache (SGLang's
  semantics), so their ``weight_version_end`` differs from ``weight_version``.
  The RL caller avoids such mixed requests by pausing with abort, or by
  waiting for a rollout to finish before it updates.
- While paused, new ``generate`` calls wait for ``continue_generation``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from transformers import AutoTokenizer

from engines import tensor_parallel as tpar
from engines.config import EngineConfig
from engines.decode import RETRACT, ModelRunner, Retract, Row, decode
from engines.engine_ranks import EngineRanks, TPRunner, engine_device, load_model, wait_all
from engines.memory_updates import InMemoryUpdates
from engines.sampling import make_generator
from engines.types import GenerateResult, PauseMode, SamplingParams, UpdateWeightsResult
from engines.weights import WeightLoadError, check_state_dict, load_into, read_state_dict

log = logging.getLogger(__name__)

CONTROL_GROUP = "control"
GENERATE_CONCURRENCY = 8
CONTROL_CONCURRENCY = 4


def actor_class() -> Any:
    """EmbeddedEngine as a Ray actor class: threaded generate + a control group.

    Concurrency groups can only be set in ``ray.remote``, not ``.options``;
    callers add placement, name and lifetime with ``.options``.
    """
    return ray.remote(
        max_concurrency=GENERATE_CONCURRENCY,
        concurrency_groups={CONTROL_GROUP: CONTROL_CONCURRENCY},
    )(EmbeddedEngine)


_control = ray.method(concurrency_group=CONTROL_GROUP)


@dataclass
class _Call:
    """One generate() call: its rows' results and a completion signal."""

    results: list[GenerateResult | None]
    remaining: int
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    rids: list[str] | None = None  # request ids, for abort_request(rid)


class EmbeddedEngine(InMemoryUpdates):
    """One rollout engine replica; see the module docstring for semantics."""

    def __init__(
        self,
        model_path: str,
        engine_id: int,
        cfg: EngineConfig,
        weight_version: int = 0,
        rank_bundles: list[int] | None = None,
    ) -> None:
        """``rank_bundles``: where ranks 1..tp_size-1 go in this actor's placement
        group (``EngineGroup`` passes them when ``engines.tp_size > 1``)."""
        torch.set_num_threads(cfg.torch_threads)
        self.engine_id = engine_id
        self._cfg = cfg
        self._device = engine_device(cfg)
        self._tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._model = load_model(model_path, cfg)
        self._ranks: EngineRanks | None = None
        if cfg.tp_size > 1:
            tpar.check_divisible(self._model.config, cfg.tp_size)
            self._ranks = EngineRanks.start(model_path, cfg, engine_id, rank_bundles or [])
            tpar.shard_model(self._model, 0, cfg.tp_size, self._ranks.group)
        self._model_path = model_path
        self._start_path = model_path  # always an allowed root for HTTP reloads
        self._weight_version = str(int(weight_version))
        self._eos = self._eos_ids()
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()  # held by each forward and by weight swaps
        # (call, index in call, prompt, params, the Row of a retracted request or None)
        self._queue: deque[tuple[_Call, int, list[int], SamplingParams, Row | None]] = deque()
        self._retract = False  # paused with mode "retract"
        self._paused = False
        self._parked = False  # worker is waiting between two steps (paused in place)
        self._inflight = 0  # rows the worker is decoding now
        self._abort_epoch = 0  # bumped to abort everything in flight
        self._abort_msg = ""
        self._released = False
        self._running: list[tuple[_Call, int, Row]] = []  # rows the worker is decoding now
        self._http = None  # engines.http_server.HttpServerThread once start_http ran
        threading.Thread(target=self._worker, name=f"engine-{engine_id}", daemon=True).start()

    def _eos_ids(self) -> frozenset[int]:
        ids = {self._tokenizer.eos_token_id}
        gen_eos = getattr(self._model.generation_config, "eos_token_id", None)
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        return frozenset(i for i in ids if i is not None)

    # ---- generation -------------------------------------------------------

    def generate(
        self,
        input_ids: list[list[int]],
        sampling_params: list[dict] | dict,
        return_logprob: bool = True,
        rid: list[str] | None = None,
    ) -> list[GenerateResult]:
        """SGLang ``/generate`` for a batch of token-id prompts.

        Each request samples with its own generator seeded by its
        ``sampling_seed``, so its tokens do not depend on the other requests
        it is batched with. ``output_token_logprobs`` holds the logprob of
        each sampled token under the temperature-scaled distribution (see
        ``engines.sampling.sample_row``); it is always returned, and
        ``return_logprob`` is accepted for API compatibility. ``rid`` names
        each request for ``abort_request``.
        """
        if isinstance(sampling_params, dict):
            sampling_params = [sampling_params] * len(input_ids)
        if len(sampling_params) != len(input_ids):
            raise ValueError("give one sampling_params dict per prompt, or one for all")
        parsed = [SamplingParams.from_dict(sp) for sp in sampling_params]
        if any(len(p) == 0 for p in input_ids):
            raise ValueError("empty prompt: every input_ids row needs >= 1 token")
        if not input_ids:
            return []
        if rid is not None and len(rid) != len(input_ids):
            raise ValueError("give one rid per prompt")
        call = _Call(results=[None] * len(input_ids), remaining=len(input_ids), rids=rid)
        with self._cond:
            while self._paused:
                self._cond.wait()
            for i, (prompt, sp) in enumerate(zip(input_ids, parsed)):
                self._queue.append((call, i, list(prompt), sp, None))
            self._cond.notify_all()
        call.done.wait()
        if call.error is not None:
            raise RuntimeError(f"engine {self.engine_id} failed a batch: {call.error}")
        return call.results  # type: ignore[return-value]

    def _worker(self) -> None:
        while True:
            with self._cond:
                while not self._queue or self._paused:
                    self._cond.wait()
                self._gather()
                batch = [
                    self._queue.popleft()
                    for _ in range(min(len(self._queue), self._cfg.max_batch_size))
                ]
                self._inflight = len(batch)
                epoch = self._abort_epoch
                rows = [row or self._row(prompt, sp) for _, _, prompt, sp, row in batch]
                self._running = [(call, i, row) for (call, i, *_), row in zip(batch, rows)]
            error = None
            try:
                decode(
                    self._runner(),
                    rows,
                    self._pad_id(),
                    self._device,
                    between_steps=lambda e=epoch: self._between_steps(e),
                    step_lock=self._step_lock,
                )
            except Exception as e:  # a failed batch must not kill the worker thread
                log.exception("engine %s: decode failed", self.engine_id)
                error = f"{type(e).__name__}: {e}"
            with self._cond:
                self._inflight = 0
                self._running = []
                retracted = []
                for item, row in zip(batch, rows):
                    if error is None and row.finish is None and self._abort_epoch == epoch:
                        retracted.append((*item[:4], row))
                    else:
                        self._deliver(item[0], item[1], row, error)
                self._queue.extendleft(reversed(retracted))  # first in line, in their order
                self._cond.notify_all()

    def _gather(self) -> None:
        """Wait up to batch_wait_s for more requests to join a non-full batch (holds cond).

        A batch runs to completion before the next one starts (no continuous
        batching), so calls that arrive a moment apart, like the per-group
        calls of ``EngineGroup.generate_groups``, should start together.
        """
        deadline = time.monotonic() + self._cfg.batch_wait_s
        while len(self._queue) < self._cfg.max_batch_size and not self._paused:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(timeout=left)

    def _runner(self) -> ModelRunner:
        """One decode call's forwards: on every rank when the engine spans several."""
        return (
            ModelRunner(self._model) if self._ranks is None else TPRunner(self._model, self._ranks)
        )

    def _row(self, prompt: list[int], sp: SamplingParams) -> Row:
        stop = self._eos if sp.stop_token_ids is None else frozenset(sp.stop_token_ids)
        return Row(
            prompt=prompt,
            params=sp,
            stop_ids=stop,
            generator=make_generator(sp.sampling_seed),
            version_start=self._weight_version,
            stop_check=self._stop_check(sp.stop) if sp.stop else None,
        )

    def _stop_check(self, stops: tuple[str, ...]):
        """A Row.stop_check that finds a stop string in the completion's decoded tail.

        Only the last few tokens are decoded each step: an earlier match would
        have ended the row already.
        """
        window = 4 * max(len(s) for s in stops) + 8

        def check(ids: list[int]) -> str | None:
            tail = self._tokenizer.decode(ids[-window:], skip_special_tokens=True)
            return next((s for s in stops if s in tail), None)

        return check

    def _pad_id(self) -> int:
        pad = self._tokenizer.pad_token_id
        return pad if pad is not None else next(iter(self._eos), 0)

    def _between_steps(self, epoch: int) -> str | Retract | None:
        """Decode hook: park while paused in place; retract; report an abort."""
        with self._cond:

            def holding() -> bool:  # paused in place, and nothing ended the batch
                return self._paused and not self._retract and self._abort_epoch == epoch

            if holding():
                self._parked = True
                self._cond.notify_all()
                while holding():
                    self._cond.wait()
                self._parked = False
            if self._abort_epoch != epoch:
                return self._abort_msg
            return RETRACT if self._paused and self._retract else None

    def _deliver(self, call: _Call, i: int, row: Row, error: str | None) -> None:
        """Store one finished row (caller holds the condition)."""
        if error is not None:
            call.error = error
        if row.finish is None:
            row.finish = {"type": "abort", "message": error or "not finished"}
        text = self._tokenizer.decode(row.output_ids, skip_special_tokens=True)
        matched = row.finish.get("matched")
        if isinstance(matched, str) and matched in text:  # SGLang trims a stop string
            text = text[: text.index(matched)]
        call.results[i] = row.result(text, self._weight_version, self.engine_id)
        call.remaining -= 1
        if call.remaining == 0:
            call.done.set()

    def _abort_all(self, message: str) -> None:
        """End in-flight and queued requests with finish reason abort (holds cond)."""
        self._abort_epoch += 1
        self._abort_msg = message
        while self._queue:
            call, i, prompt, sp, row = self._queue.popleft()
            row = row or self._row(prompt, sp)
            row.finish = {"type": "abort", "message": message}
            self._deliver(call, i, row, None)
        self._cond.notify_all()

    # ---- pause / continue -------------------------------------------------

    @_control
    def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Stop generating; returns once no forward is running."""
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"mode={mode!r}: use 'abort', 'in_place' or 'retract'")
        with self._cond:
            self._paused = True
            self._retract = mode == "retract"
            if mode == "abort":
                self._abort_all("aborted by pause_generation")
            self._cond.notify_all()
            # In place: until the worker parks. Retract or abort: until it has let go
            # of its batch.
            while self._inflight and not (self._parked and not self._retract):
                self._cond.wait()

    def _paused_requests(self) -> int:
        """Requests held by a pause (not aborted): parked in place, or retracted to
        the queue. SGLang's ``num_paused_requests`` (caller holds cond)."""
        if not self._paused:
            return 0
        retracted = sum(row is not None for *_, row in self._queue)
        return (self._inflight if self._parked else 0) + retracted

    @_control
    def continue_generation(self) -> None:
        with self._cond:
            self._paused = False
            self._retract = False
            self._cond.notify_all()

    @_control
    def flush_cache(self) -> bool:
        """Drop cached state; refused (False) while any request is queued or running.

        The engine keeps no prefix cache across requests, so an idle flush only
        returns freed device memory to the allocator.
        """
        with self._cond:
            if self._inflight or self._queue:
                return False
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    # ---- weights and info -------------------------------------------------

    @_control
    def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> UpdateWeightsResult:
        """Load an HF safetensors dir into the running model, all or nothing.

        The new tensors are read and checked before any parameter changes; on
        failure the old weights and version keep serving. The swap happens
        between two decode steps (it takes the step lock).
        """
        if abort_all_requests:
            with self._cond:
                self._abort_all("aborted by update_weights_from_disk")
        # Every rank reads and checks its slice before any rank swaps (all or nothing).
        staged = [] if self._ranks is None else self._ranks.submit("stage_from_disk", model_path)
        try:
            state = tpar.shard_state(read_state_dict(model_path), 0, self._cfg.tp_size)
            check_state_dict(self._model, state)
            errors = [e for e in wait_all(staged) if e is not None]
            if errors:
                raise WeightLoadError("; ".join(errors))
        except (WeightLoadError, OSError) as e:
            if self._ranks is not None:
                ray.get(self._ranks.submit("drop_staged"))
            with self._cond:
                paused = self._paused_requests()
            return {"success": False, "message": str(e), "num_paused_requests": paused}
        with self._step_lock:
            commits = [] if self._ranks is None else self._ranks.submit("commit_staged")
            load_into(self._model, state)
            wait_all(commits)
            with self._cond:
                if weight_version is not None:
                    self._weight_version = str(weight_version)
                self._model_path = model_path
                paused = self._paused_requests()
        if flush_cache:
            self.flush_cache()
        msg = f"loaded {model_path} as version {self._weight_version}"
        return {"success": True, "message": msg, "num_paused_requests": paused}

    @_control
    def update_weight_version(self, new_version: str) -> str:
        """Relabel the served weights (after a tensor/distributed update)."""
        with self._cond:
            self._weight_version = str(new_version)
            return self._weight_version

    @_control
    def get_weight_version(self) -> str:
        return self._weight_version

    @_control
    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self._model_path,
            "tokenizer_path": self._model_path,
            "is_generation": True,
            "weight_version": self._weight_version,
            "engine_id": self.engine_id,
            "device": str(self._device),
            "tp_size": self._cfg.tp_size,
            "paused": self._paused,
        }

    @_control
    def rank_pids(self) -> list[int]:
        """Process ids of every rank of this engine, rank 0 (this actor) first."""
        return [os.getpid(), *([] if self._ranks is None else self._ranks.pids())]

    @_control
    def get_load(self) -> dict[str, int]:
        """Requests decoding now and waiting in the queue (SGLang's ``/get_load`` counts)."""
        with self._cond:
            return {"num_running_reqs": self._inflight, "num_waiting_reqs": len(self._queue)}

    @_control
    def health_generate(self) -> bool:
        """A 1-token greedy generation outside the queue, so it answers while paused."""
        bos = self._tokenizer.bos_token_id
        row = self._row(
            [bos if bos is not None else self._pad_id()],
            SamplingParams(temperature=0.0, max_new_tokens=1, stop_token_ids=()),
        )
        try:
            decode(self._runner(), [row], self._pad_id(), self._device, step_lock=self._step_lock)
        except Exception:
            log.exception("engine %s: health_generate failed", self.engine_id)
            return False
        return len(row.output_ids) == 1

    # ---- memory -----------------------------------------------------------

    @_control
    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Free the weights' device memory for a colocated trainer (``engines.device_memory``:
        torch_memory_saver where installed, else moved to host memory; on CPU only
        the state changes, so colocated runs make the same calls everywhere).

        ``tags`` is accepted for API compatibility; weights are the only state
        this engine holds between requests. Idle engines only: a forward needs
        the weights (the colocated steps wake engines before they generate).
        Idempotent; the reply adds the memory report (``state``, ``mode`` ...).
        """
        from engines.device_memory import actor_memory

        with self._step_lock:
            report = actor_memory(self, self._device, "weights").sleep([self._model])
            if self._ranks is not None:
                ray.get(self._ranks.submit("release"))
            self._released = True
        return {"success": True, "message": f"released (device={self._device})", **report}

    @_control
    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Undo ``release_memory_occupation``: the weights are back, unchanged. Idempotent."""
        from engines.device_memory import actor_memory

        with self._step_lock:
            report = actor_memory(self, self._device, "weights").wake([self._model])
            if self._ranks is not None:
                ray.get(self._ranks.submit("resume"))
            self._released = False
        return {"success": True, "message": f"resumed (device={self._device})", **report}

    # ---- requests, tokens and the HTTP front door ---------------------------

    @_control
    def abort_request(self, rid: str = "", abort_all: bool = False) -> int:
        """SGLang ``/abort_request``: end one request (by rid) or all with finish reason abort.

        Queued requests end at once; running ones at their next decode step.
        Returns how many requests were aborted.
        """
        msg = "aborted by abort_request"
        with self._cond:
            if abort_all:
                n = len(self._queue) + self._inflight
                self._abort_all(msg)
                return n
            n, kept = 0, deque()
            for item in self._queue:
                call, i, prompt, sp, row = item
                if call.rids is not None and call.rids[i] == rid:
                    row = row or self._row(prompt, sp)
                    row.finish = {"type": "abort", "message": msg}
                    self._deliver(call, i, row, None)
                    n += 1
                else:
                    kept.append(item)
            self._queue = kept
            for call, i, row in self._running:
                if call.rids is not None and call.rids[i] == rid and row.finish is None:
                    row.finish = {"type": "abort", "message": msg}
                    n += 1
            self._cond.notify_all()
            return n

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, as SGLang tokenizes a ``text`` prompt."""
        return [self._tokenizer.encode(t) for t in texts]

    def eos_token_ids(self) -> list[int]:
        """The ids that end a request unless ``ignore_eos`` (SGLang adds stop_token_ids to them)."""
        return sorted(self._eos)

    @_control
    def start_http(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        allowed_roots: list[str] | None = None,
        api_key: str | None = None,
    ) -> str:
        """Serve SGLang's HTTP API for this engine from a thread of this process; returns its URL.

        Idempotent: a second call returns the running server's URL. Weight
        reloads over HTTP are limited to ``allowed_roots`` (plus the
        ``engines.allowed_weight_roots`` of the config and the directory the
        engine started from); the bearer token defaults to the environment
        variable named by ``engines.api_key_env``.
        """
        from engines.http_server import ServerSettings, serve_in_thread

        if self._http is None:
            roots = [*(allowed_roots or []), *self._cfg.allowed_weight_roots, self._start_path]
            settings = ServerSettings(
                host=host,
                port=port,
                api_key=api_key or os.environ.get(self._cfg.api_key_env) or None,
                allowed_roots=tuple(roots),
            )
            self._http = serve_in_thread(self, settings)
        return self._http.url

    @_control
    def http_url(self) -> str | None:
        return None if self._http is None else self._http.url

    @_control
    def stop_http(self) -> None:
        if self._http is not None:
            self._http.stop()
            self._http = None
