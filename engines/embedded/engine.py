"""The embedded rollout engine: torch + transformers behind SGLang's control API.

Owns one model replica, its control surface (weights, versions, memory, info,
health, the HTTP front door) and the checks a request must pass before it is
queued (``RequestLimits``: token ids in the vocabulary, prompt +
max_new_tokens within the context length, a seed in [0, 2**63-1]). Its
collaborators, each made here and handed what it needs: ``served``
(``ServedModel``: the model, its ranks, the weight version and the locks they
share), ``tokens`` (``Tokens``: EOS, padding, stop strings, text), ``batcher``
(``Batcher``: the queue, the decode worker, pausing and deadlines), ``updates``
(``InMemoryUpdates``: tensor and broadcast weight updates), ``adapters``
(``AdapterMerge``: the LoRA adapter it serves, merged into its weights) and
``memory`` (``DeviceMemory``: sleep and wake). The Ray-visible methods that are theirs
delegate to them under the same names. Method names and result shapes follow
SGLang's HTTP endpoints (``/generate``, ``/update_weights_from_disk``,
``/pause_generation`` ...), so callers cannot tell it from an SGLang server. It is a plain class; ``engines.group`` wraps it
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

from actors.device_memory import DeviceMemory
from actors.options import CONTROL_CONCURRENCY, CONTROL_GROUP, GENERATE_CONCURRENCY
from engines.config import EngineConfig
from engines.embedded import tensor_parallel as tpar
from engines.embedded.adapters import AdapterMerge
from engines.embedded.batching import Batcher, EngineDeadError
from engines.embedded.decode import Row, decode
from engines.embedded.engine_ranks import EngineRanks, engine_device, load_model, wait_all
from engines.embedded.memory_updates import InMemoryUpdates
from engines.embedded.served_model import ServedModel
from engines.embedded.tokens import Tokens
from engines.embedded.weight_files import read_manifest, read_state_dict
from engines.types import (
    GenerateResult,
    PauseMode,
    RequestLimits,
    SamplingParams,
    UpdateWeightsResult,
)
from engines.weights import check_state_dict, load_into
from wire.errors import WeightLoadError, WeightPathError

log = logging.getLogger(__name__)

__all__ = ["EmbeddedEngine", "EngineDeadError", "actor_class"]


def _digest(model_dir: str) -> str | None:
    """The files digest of the weights in ``model_dir`` (its manifest.json), the identity
    adapters are checked against; None without a manifest."""
    manifest = read_manifest(model_dir)
    return None if manifest is None else manifest.digest()


@functools.cache
def actor_class() -> Any:
    """EmbeddedEngine as a Ray actor class (``actors.options``). Built once: Ray
    exports each class object once, at ~30 ms of CPU (it disassembles the class)."""
    return ray.remote(
        max_concurrency=GENERATE_CONCURRENCY,
        concurrency_groups={CONTROL_GROUP: CONTROL_CONCURRENCY},
    )(EmbeddedEngine)


_control = ray.method(concurrency_group=CONTROL_GROUP)


class EmbeddedEngine:
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
        device = engine_device(cfg)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = load_model(model_path, cfg)
        ranks: EngineRanks | None = None
        if cfg.tp_size > 1:
            tpar.check_divisible(model.config, cfg.tp_size)
            ranks = EngineRanks.start(model_path, cfg, engine_id, rank_bundles or [])
            tpar.shard_model(model, 0, cfg.tp_size, ranks.group)
        self._model_path = model_path
        self._start_path = model_path  # always an allowed root for HTTP reloads
        self.served = ServedModel(model, device, ranks, str(int(weight_version)))
        self.tokens = Tokens(tokenizer, model.generation_config)
        self.limits = self._limits()
        self.memory = DeviceMemory(device, "weights")  # released for a colocated trainer
        self._http = None  # engines.embedded.http_server.HttpServerThread once start_http ran
        self.batcher = Batcher(self.served, self.tokens, cfg, engine_id)  # starts the worker
        # The folder it started from is the base adapters apply to (load_model verified it).
        self.adapters = AdapterMerge(self.served, self.batcher, _digest(model_path))
        self.updates = InMemoryUpdates(
            self.served, self.batcher, cfg.tp_size, on_weights=self.adapters.full_loaded
        )

    def _limits(self) -> RequestLimits:
        # The embedding's rows, not config.vocab_size: the forward indexes those.
        model = self.served.model
        vocab = model.get_input_embeddings().weight.shape[0]
        ctx = self._cfg.context_length or getattr(model.config, "max_position_embeddings", 0)
        if not ctx:
            raise ValueError(
                "the model's config has no max_position_embeddings: set engines.context_length"
            )
        return RequestLimits(vocab_size=int(vocab), context_length=int(ctx))

    # ---- generation -------------------------------------------------------

    def generate(
        self,
        input_ids: list[list[int]],
        sampling_params: list[dict] | dict,
        return_logprob: bool = True,
        rid: list[str] | None = None,
        lora_path: str | None = None,
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
        EngineDeadError if the decode loop has died. ``lora_path`` (SGLang's
        adapter of the request) must name the adapter this engine serves, if given:
        it holds one, merged in, so a request for another is a ValueError.
        """
        if lora_path is not None and lora_path != self.adapters.name:
            raise ValueError(
                f"the request samples from adapter {lora_path!r}, but this engine serves "
                f"{self.adapters.name or 'its base weights'} (it holds one adapter at a time)"
            )
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
        return self.batcher.submit(prompts, parsed, rid)

    # ---- pause, continue, abort and load (the batcher's) -------------------

    @_control
    def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Stop generating; returns once no forward is running (``Batcher.pause_generation``)."""
        self.batcher.pause_generation(mode)

    @_control
    def continue_generation(self) -> None:
        self.batcher.continue_generation()

    @_control
    def abort_request(self, rid: str = "", abort_all: bool = False) -> int:
        """SGLang ``/abort_request``: end one request (by rid) or all with finish reason
        abort; how many were aborted (``Batcher.abort_request``)."""
        return self.batcher.abort_request(rid, abort_all)

    @_control
    def flush_cache(self) -> bool:
        """Drop cached state; refused (False) while any request is queued or running."""
        return self.batcher.flush_cache()

    @_control
    def get_load(self) -> dict[str, int]:
        """Requests decoding now and waiting in the queue (SGLang's ``/get_load`` counts)."""
        return self.batcher.get_load()

    def decode_alive(self) -> bool:
        """False once the decode worker thread has died (the engine needs a restart)."""
        return self.batcher.decode_alive()

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
        served, batcher = self.served, self.batcher
        if abort_all_requests:
            with served.cond:
                batcher.abort_all("aborted by update_weights_from_disk")
        roots = None if allowed_roots is None else tuple(allowed_roots)
        ranks = served.ranks
        # Every rank reads and checks its slice before any rank swaps (all or nothing).
        staged = [] if ranks is None else ranks.submit("stage_from_disk", model_path, roots)
        try:
            state = tpar.shard_state(read_state_dict(model_path, roots), 0, self._cfg.tp_size)
            check_state_dict(served.model, state)
            errors = [e for e in wait_all(staged) if e is not None]
            if errors:
                raise WeightLoadError("; ".join(errors))
        except (WeightLoadError, OSError) as e:
            if ranks is not None:
                wait_all(staged)  # let every rank finish reading before it drops
                ray.get(ranks.submit("drop_staged"))
            if isinstance(e, WeightPathError):
                raise
            log.warning("engine %s: refused to load %s: %s", self.engine_id, model_path, e)
            with served.cond:
                paused = batcher.paused_requests()
            return {"success": False, "message": str(e), "num_paused_requests": paused}
        with served.step_lock:
            commits = [] if ranks is None else ranks.submit("commit_staged")
            load_into(served.model, state)
            wait_all(commits)
            self.adapters.full_loaded(_digest(model_path))
            with served.cond:
                if weight_version is not None:
                    served.version = str(weight_version)
                self._model_path = model_path
                paused = batcher.paused_requests()
        if flush_cache:
            batcher.flush_cache()
        msg = f"loaded {model_path} as version {served.version}"
        return {"success": True, "message": msg, "num_paused_requests": paused}

    # ---- LoRA adapters (the adapters') -------------------------------------

    @_control
    def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str,
        flush_cache: bool = True,
        allowed_roots: tuple[str, ...] | None = None,
    ) -> UpdateWeightsResult:
        """Serve the peft adapter folder ``lora_path`` as ``lora_name`` (``v{k}``: the
        engine then serves version k), merged into the base weights, all or nothing
        (``AdapterMerge.load_from_disk``). ``allowed_roots`` confines every file opened."""
        roots = None if allowed_roots is None else tuple(allowed_roots)
        return self.adapters.load_from_disk(lora_name, lora_path, roots, flush_cache)

    @_control
    def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        config_dict: dict[str, Any],
        serialized_named_tensors: list[dict[str, Any]],
        load_format: str = "flattened_bucket",
        flush_cache: bool = False,
        expected_checksums: dict[str, str] | None = None,
    ) -> UpdateWeightsResult:
        """Serve the adapter behind one bucket handle as ``lora_name``, its tensors
        checked against ``expected_checksums`` (sha256 each) when given
        (``AdapterMerge.load_from_tensors``)."""
        return self.adapters.load_from_tensors(
            lora_name,
            config_dict,
            serialized_named_tensors,
            load_format,
            flush_cache,
            expected_checksums,
        )

    @_control
    def unload_lora_adapter(self, lora_name: str) -> UpdateWeightsResult:
        """Back to the base weights and version if ``lora_name`` is served."""
        return self.adapters.unload(lora_name)

    @_control
    def update_weight_version(self, new_version: str) -> str:
        """Relabel the served weights (after a tensor/distributed update)."""
        with self.served.cond:
            self.served.version = str(new_version)
            return self.served.version

    @_control
    def get_weight_version(self) -> str:
        return self.served.version

    # ---- in-memory weight updates (the updates') ----------------------------

    @_control
    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[dict[str, Any]],
        load_format: str = "flattened_bucket",
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> UpdateWeightsResult:
        """Copy the buckets behind the tensor handles into the model, one handle per
        rank (``InMemoryUpdates.update_weights_from_tensor``)."""
        return self.updates.update_weights_from_tensor(
            serialized_named_tensors, load_format, flush_cache, weight_version
        )

    @_control
    def update_socket(self) -> dict[str, Any] | None:
        """Where a producer on this host signals cached updates; None for several ranks."""
        return self.updates.update_socket()

    @_control
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
    ) -> dict[str, Any]:
        """Join the broadcast group of trainer rank 0 as ``rank_offset`` (+ j for rank j)."""
        return self.updates.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )

    @_control
    def has_weights_update_group(self, group_name: str) -> bool:
        return self.updates.has_weights_update_group(group_name)

    @_control
    def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        return self.updates.destroy_weights_update_group(group_name)

    @_control
    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> UpdateWeightsResult:
        """Receive one bucket by broadcast from rank 0 of ``group_name`` and copy it in."""
        return self.updates.update_weights_from_distributed(
            names, dtypes, shapes, group_name, flush_cache, weight_version
        )

    @_control
    def begin_weight_update(self) -> dict[str, Any]:
        return self.updates.begin_weight_update()

    @_control
    def end_weight_update(self) -> dict[str, Any]:
        return self.updates.end_weight_update()

    @_control
    def state_sha256(self) -> str:
        """sha256 over (name, dtype, shape, bytes) of the model's state dict, sorted by name."""
        return self.updates.state_sha256()

    @_control
    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self._model_path,
            "tokenizer_path": self._model_path,
            "is_generation": True,
            "weight_version": self.served.version,
            "lora_name": self.adapters.name,  # the adapter merged in (None: the base)
            "engine_id": self.engine_id,
            "device": str(self.served.device),
            "tp_size": self._cfg.tp_size,
            "paused": self.batcher.paused,
        }

    @_control
    def rank_pids(self) -> list[int]:
        """Process ids of every rank of this engine, rank 0 (this actor) first."""
        ranks = self.served.ranks
        return [os.getpid(), *([] if ranks is None else ranks.pids())]

    @_control
    def health_generate(self) -> bool:
        """False once the decode loop has died; else a 1-token greedy generation
        outside the queue, so it answers while paused."""
        if not self.batcher.decode_alive():
            return False
        served = self.served
        row = Row(
            [self.tokens.bos_id()],
            SamplingParams(temperature=0.0, max_new_tokens=1, stop_token_ids=()),
            frozenset(),
            torch.Generator(device="cpu"),
            served.version,
        )
        try:
            pad = self.tokens.pad_id()
            decode(served.runner(), [row], pad, served.device, step_lock=served.step_lock)
        except Exception:
            log.exception("engine %s: health_generate failed", self.engine_id)
            return False
        return len(row.output_ids) == 1

    @_control
    def is_alive(self) -> bool:
        """The decode loop runs (cheap; ``health_generate`` also runs a forward)."""
        return self.batcher.decode_alive()

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
        served = self.served
        with served.step_lock:
            report = self.memory.sleep([served.model])
            if served.ranks is not None:
                ray.get(served.ranks.submit("release"))
        return {"success": True, "message": f"released (device={served.device})", **report}

    @_control
    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Undo ``release_memory_occupation``: the weights are back, unchanged. Idempotent."""
        served = self.served
        with served.step_lock:
            report = self.memory.wake([served.model])
            if served.ranks is not None:
                ray.get(served.ranks.submit("resume"))
        return {"success": True, "message": f"resumed (device={served.device})", **report}

    # ---- tokens and the HTTP front door -----------------------------------

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, as SGLang tokenizes a ``text`` prompt."""
        return self.tokens.encode(texts)

    def eos_token_ids(self) -> list[int]:
        """The ids that end a request unless ``ignore_eos`` (SGLang adds stop_token_ids to them)."""
        return sorted(self.tokens.eos)

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
