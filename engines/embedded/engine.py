"""The embedded rollout engine: torch + transformers behind SGLang's control API.

Owns one model replica, its control surface (weights, versions, memory, info,
health, the HTTP front door) and the checks a request must pass before it is
queued (``RequestLimits``: token ids in the vocabulary, prompt +
max_new_tokens within the context length, a seed in [0, 2**63-1]); the queue,
the decode worker, pausing and deadlines are ``engines.embedded.batching``. Method
names and result shapes follow SGLang's HTTP endpoints (``/generate``,
``/update_weights_from_disk``, ``/pause_generation`` ...), so callers cannot
tell it from an SGLang server. It is a plain class; ``engines.group`` wraps it
as a threaded Ray actor (see ``actor_class``). It never imports prefect and
never reads anything but the local HF directory it is pointed at (verified
against its manifest.json, ``engines.embedded.weight_files``).

Threads: ``generate`` calls (up to ``GENERATE_CONCURRENCY`` at once) check
their rows, enqueue them and wait. One decode worker thread drains the queue
into batches of up to ``max_batch_size`` rows of one call each (a row's numbers
never depend on another call's); a failing request fails alone
(``engines.embedded.batching``).
Control methods run in their own concurrency group, so pause, continue and
reload are served while every generate thread is busy.

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

import functools
import logging
import os
from typing import Any

import ray
import torch
from transformers import AutoTokenizer

from actors.options import CONTROL_CONCURRENCY, CONTROL_GROUP, GENERATE_CONCURRENCY
from engines.config import EngineConfig
from engines.embedded import tensor_parallel as tpar
from engines.embedded.batching import Batcher, EngineDeadError
from engines.embedded.decode import Row, decode
from engines.embedded.engine_ranks import EngineRanks, engine_device, load_model, wait_all
from engines.embedded.memory_updates import InMemoryUpdates
from engines.embedded.sampling import make_generator
from engines.embedded.weight_files import read_state_dict
from engines.types import GenerateResult, RequestLimits, SamplingParams, UpdateWeightsResult
from engines.weights import check_state_dict, load_into
from wire.errors import WeightLoadError, WeightPathError

log = logging.getLogger(__name__)

__all__ = ["EmbeddedEngine", "EngineDeadError", "actor_class"]


@functools.cache
def actor_class() -> Any:
    """EmbeddedEngine as a Ray actor class (``actors.options``). Built once: Ray
    exports each class object once, at ~30 ms of CPU (it disassembles the class)."""
    return ray.remote(
        max_concurrency=GENERATE_CONCURRENCY,
        concurrency_groups={CONTROL_GROUP: CONTROL_CONCURRENCY},
    )(EmbeddedEngine)


_control = ray.method(concurrency_group=CONTROL_GROUP)


class EmbeddedEngine(Batcher, InMemoryUpdates):
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
        self.limits = self._limits()
        self._released = False
        self._http = None  # engines.embedded.http_server.HttpServerThread once start_http ran
        self._start_batching()

    def _eos_ids(self) -> frozenset[int]:
        ids = {self._tokenizer.eos_token_id}
        gen_eos = getattr(self._model.generation_config, "eos_token_id", None)
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        return frozenset(i for i in ids if i is not None)

    def _limits(self) -> RequestLimits:
        # The embedding's rows, not config.vocab_size: the forward indexes those.
        vocab = self._model.get_input_embeddings().weight.shape[0]
        ctx = self._cfg.context_length or getattr(self._model.config, "max_position_embeddings", 0)
        if not ctx:
            raise ValueError(
                "the model's config has no max_position_embeddings: set engines.context_length"
            )
        return RequestLimits(vocab_size=int(vocab), context_length=int(ctx))

    # ---- rows -------------------------------------------------------------

    def _row(self, prompt: list[int], sp: SamplingParams, deadline: float | None = None) -> Row:
        stop = self._eos if sp.stop_token_ids is None else frozenset(sp.stop_token_ids)
        return Row(
            prompt=prompt,
            params=sp,
            stop_ids=stop,
            generator=make_generator(sp.sampling_seed),
            version_start=self._weight_version,
            stop_check=self._stop_check(sp.stop) if sp.stop else None,
            deadline=deadline,
        )

    def _stop_check(self, stops: tuple[str, ...]) -> Any:
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
        ``engines.embedded.sampling.sample_row``); it is always returned, and
        ``return_logprob`` is accepted for API compatibility. ``rid`` names
        each request for ``abort_request``. A row that breaks the model's
        limits (``self.limits``) is a ValueError for this call alone;
        EngineDeadError if the decode loop has died.
        """
        if isinstance(sampling_params, dict):
            sampling_params = [sampling_params] * len(input_ids)
        if len(sampling_params) != len(input_ids):
            raise ValueError("give one sampling_params dict per prompt, or one for all")
        parsed = [SamplingParams.from_dict(sp) for sp in sampling_params]
        prompts = [self.limits.check(p, sp) for p, sp in zip(input_ids, parsed)]
        if not prompts:
            return []
        if rid is not None and len(rid) != len(prompts):
            raise ValueError("give one rid per prompt")
        return self._submit(prompts, parsed, rid)

    # ---- weights and info -------------------------------------------------

    @_control
    def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        allowed_roots: tuple[str, ...] | None = None,
    ) -> UpdateWeightsResult:
        """Load an HF safetensors dir into the running model, all or nothing.

        The new tensors are read, verified against the directory's manifest.json
        when it has one (sizes and sha256) and checked before any parameter
        changes; on failure the old weights and version keep serving. The swap
        happens between two decode steps (it takes the step lock).
        ``allowed_roots`` (the HTTP server passes its own) confines every file
        opened; a file outside them raises WeightPathError instead of a result.
        """
        if abort_all_requests:
            with self._cond:
                self._abort_all("aborted by update_weights_from_disk")
        roots = None if allowed_roots is None else tuple(allowed_roots)
        # Every rank reads and checks its slice before any rank swaps (all or nothing).
        staged = (
            [] if self._ranks is None else self._ranks.submit("stage_from_disk", model_path, roots)
        )
        try:
            state = tpar.shard_state(read_state_dict(model_path, roots), 0, self._cfg.tp_size)
            check_state_dict(self._model, state)
            errors = [e for e in wait_all(staged) if e is not None]
            if errors:
                raise WeightLoadError("; ".join(errors))
        except (WeightLoadError, OSError) as e:
            if self._ranks is not None:
                wait_all(staged)  # let every rank finish reading before it drops
                ray.get(self._ranks.submit("drop_staged"))
            if isinstance(e, WeightPathError):
                raise
            log.warning("engine %s: refused to load %s: %s", self.engine_id, model_path, e)
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
    def health_generate(self) -> bool:
        """False once the decode loop has died; else a 1-token greedy generation
        outside the queue, so it answers while paused."""
        if not self.decode_alive():
            return False
        bos = self._tokenizer.bos_token_id
        row = Row(
            [bos if bos is not None else self._pad_id()],
            SamplingParams(temperature=0.0, max_new_tokens=1, stop_token_ids=()),
            frozenset(),
            torch.Generator(device="cpu"),
            self._weight_version,
        )
        try:
            decode(self._runner(), [row], self._pad_id(), self._device, step_lock=self._step_lock)
        except Exception:
            log.exception("engine %s: health_generate failed", self.engine_id)
            return False
        return len(row.output_ids) == 1

    @_control
    def is_alive(self) -> bool:
        """The decode loop runs (cheap; ``health_generate`` also runs a forward)."""
        return self.decode_alive()

    # ---- memory -----------------------------------------------------------

    @_control
    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Free the weights' device memory for a colocated trainer (``actors.device_memory``:
        torch_memory_saver where installed, else moved to host memory; on CPU only
        the state changes, so colocated runs make the same calls everywhere).

        ``tags`` is accepted for API compatibility; weights are the only state
        this engine holds between requests. Idle engines only: a forward needs
        the weights (the colocated steps wake engines before they generate).
        Idempotent; the reply adds the memory report (``state``, ``mode`` ...).
        """
        from actors.device_memory import actor_memory

        with self._step_lock:
            report = actor_memory(self, self._device, "weights").sleep([self._model])
            if self._ranks is not None:
                ray.get(self._ranks.submit("release"))
            self._released = True
        return {"success": True, "message": f"released (device={self._device})", **report}

    @_control
    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Undo ``release_memory_occupation``: the weights are back, unchanged. Idempotent."""
        from actors.device_memory import actor_memory

        with self._step_lock:
            report = actor_memory(self, self._device, "weights").wake([self._model])
            if self._ranks is not None:
                ray.get(self._ranks.submit("resume"))
            self._released = False
        return {"success": True, "message": f"resumed (device={self._device})", **report}

    # ---- tokens and the HTTP front door -----------------------------------

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
        from engines.embedded.http_server import ServerSettings, serve_in_thread

        if self._http is None:
            roots = [*(allowed_roots or []), *self._cfg.allowed_weight_roots, self._start_path]
            # '~' is this node's home: a node cache (engines.local_cache_dir) is per node.
            roots = [os.path.expanduser(r) for r in roots]
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
