"""``SGLangEngine``: the Ray actor that owns one SGLang server and speaks for it.

It answers the embedded engine's Ray methods by calling its server over HTTP
(``engines.client``), so ``EngineGroup``, reload, verify and the in-memory
transports drive both kinds alike. Weight updates:

- ``update_weights_from_disk``: the server loads the version folder itself;
- ``update_weights_from_tensor``: the trainer's handles are SGLang payloads
  already (``wire.sglang_payload``: ``model_info`` says ``weight_wire:
  sglang``), one per TP rank; this actor only posts them with
  ``load_format: flattened_bucket``;
- ``init_weights_update_group`` / ``update_weights_from_distributed``: the
  server joins the trainer's NCCL group and receives each bucket as one flat
  broadcast (``load_format: flattened_bucket``);
- ``load_lora_adapter_from_tensors``: a LoRA adapter version (``train.lora``,
  launched with ``adapters``' flags) as one SGLang payload per TP rank, with the
  sha256 of each tensor for the server to check. A version already loaded is not
  loaded again (the server refuses a name twice; versions are immutable). Each
  request names the adapter it samples from (``generate``'s ``lora_path``).

A refused update is a result (``success: False``), as on the embedded engine.
An endpoint the server lacks (404) is an error naming the server's version.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import ray

from actors.options import CONTROL_CONCURRENCY, CONTROL_GROUP, GENERATE_CONCURRENCY
from engines.client import EngineClient, EngineHTTPError
from engines.config import EngineConfig
from engines.sglang.folder_check import refusal, start_shapes
from engines.sglang.server import SGLangServer
from engines.types import AdapterServing, GenerateResult, PauseMode, UpdateWeightsResult
from wire.lora import version_of

log = logging.getLogger(__name__)

_control = ray.method(concurrency_group=CONTROL_GROUP)
TESTED_API = "0.5.x (tested on 0.5.17)"
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES


@functools.cache
def actor_class() -> Any:
    """SGLangEngine as a threaded Ray actor with the embedded engine's control group
    (built once, as ``engines.embedded.actor_class`` is)."""
    return ray.remote(
        max_concurrency=GENERATE_CONCURRENCY,
        concurrency_groups={CONTROL_GROUP: CONTROL_CONCURRENCY},
    )(SGLangEngine)


class SGLangEngine:
    """One SGLang server process, started in ``__init__`` and ready when it returns."""

    def __init__(
        self,
        model_path: str,
        engine_id: int,
        cfg: EngineConfig,
        weight_version: int = 0,
        adapters: AdapterServing | None = None,
    ) -> None:
        """``adapters``: launch with LoRA on (the run's versions are adapters)."""
        self.engine_id = engine_id
        self._cfg = cfg
        self._start_shapes = start_shapes(model_path)  # what every reload must hold
        api_key = os.environ.get(cfg.api_key_env) or None
        self._server = SGLangServer(
            model_path, engine_id, cfg.sglang, cfg.tp_size, weight_version, api_key, adapters
        )
        self.url = self._server.url
        self.command = self._server.command  # token hidden
        self.log_path = self._server.log_path
        self.client = EngineClient(self.url, api_key=api_key, retries=2)
        self.startup_s = self._server.wait_ready(self.client)
        self._groups: set[str] = set()  # broadcast groups this server has joined
        self._released: set[str] = set()  # memory tags the server holds released
        self._version_text: str | None = None
        log.info("engine %d: SGLang ready in %.1fs at %s", engine_id, self.startup_s, self.url)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args)`` on the client; a 404 names the server's version and the API driven."""
        try:
            return fn(*args, **kwargs)
        except EngineHTTPError as e:
            if e.status != 404:
                raise
            raise RuntimeError(
                f"SGLang {self.server_version()} at {self.url} has no {e.path} ({what}); "
                f"prefect-rl drives SGLang {TESTED_API}: install that version"
            ) from None

    def _result(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> UpdateWeightsResult:
        """A weight update's reply; a refusal (4xx) is a result, as on the embedded engine."""
        try:
            reply = self._call(what, fn, *args, **kwargs)
        except EngineHTTPError as e:
            return {"success": False, "message": e.message, "num_paused_requests": 0}
        return {"num_paused_requests": 0, **reply}

    # ---- process ----------------------------------------------------------

    @_control
    def is_running(self) -> bool:
        return self._server.is_running()

    @_control
    def pid(self) -> int:
        return self._server.pid

    @_control
    def log_tail(self, lines: int = 40) -> str:
        return self._server.log_tail(lines)

    @_control
    def stop(self) -> int:
        return self._server.stop()

    @_control
    def http_url(self) -> str:
        return self.url

    @_control
    def server_version(self) -> str:
        """SGLang's version as ``/server_info`` reports it ("unknown" if it does not)."""
        if self._version_text is None:
            try:
                self._version_text = str(self.client.server_info().get("version", "unknown"))
            except (EngineHTTPError, OSError, TimeoutError):
                return "unknown"
        return self._version_text

    # ---- the embedded engine's Ray methods, over HTTP ---------------------

    def generate(
        self,
        input_ids: list[list[int]],
        sampling_params: list[dict] | dict,
        return_logprob: bool = True,
        rid: list[str] | None = None,
        lora_path: str | None = None,
    ) -> list[GenerateResult]:
        """``lora_path``: the adapter version every request samples from (None: the
        base); its results report that version, as the server reports its base's."""
        if not input_ids:
            return []
        out = self.client.generate(
            input_ids=[list(p) for p in input_ids],
            sampling_params=sampling_params,
            return_logprob=return_logprob,
            rid=rid,
            lora_path=lora_path,
        )
        if lora_path is not None:  # the weights it ran on: base + adapter v{k} = version k
            version = str(version_of(lora_path))
            for result in out if isinstance(out, list) else [out]:
                result["meta_info"]["weight_version"] = version
        return out

    @_control
    def get_weight_version(self) -> str:
        return self._call("the served version", self.client.get_weight_version)

    @_control
    def model_info(self) -> dict[str, Any]:
        info = self._call("model_info", self.client.model_info)
        # What the trainer's pushers ask: the ranks to serve, and the payload format.
        return {**info, "tp_size": self._cfg.tp_size, "weight_wire": "sglang"}

    @_control
    def health_generate(self) -> bool:
        """The process runs and its scheduler answers a round trip (``/server_info``
        asks the scheduler for its internal state). Not SGLang's ``/health_generate``:
        that one sleeps a whole second before it looks (0.5.17), and the steps ask
        before every rollout, reload and verify: 1 s each of a 0.5B iteration's 3.3 s
        on the H100."""
        if not self.is_running():
            return False
        try:
            self.client.request("GET", "/server_info")
        except (EngineHTTPError, TimeoutError):
            return False
        return True

    @_control
    def get_load(self) -> dict[str, int]:
        load = self._call("load", self.client.request, "GET", "/get_load").json()
        total = sum(d.get("num_reqs", 0) for d in load)
        waiting = sum(d.get("num_waiting_reqs", 0) for d in load)
        return {"num_running_reqs": total - waiting, "num_waiting_reqs": waiting}

    @_control
    def pause_generation(self, mode: PauseMode = "abort") -> None:
        self._call("pause", self.client.pause_generation, mode)

    @_control
    def continue_generation(self) -> None:
        self._call("continue", self.client.continue_generation)

    @_control
    def flush_cache(self) -> bool:
        return self.client.flush_cache()

    @_control
    def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> UpdateWeightsResult:
        """The server loads ``model_path`` itself, once it holds every tensor of the
        start folder in its shape (``engines.sglang.folder_check``)."""
        why = refusal(model_path, self._start_shapes)
        if why is not None:
            return {"success": False, "message": why, "num_paused_requests": 0}
        return self._result(
            "disk reload",
            self.client.update_weights_from_disk,
            model_path,
            weight_version,
            flush_cache,
            abort_all_requests,
        )

    @_control
    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str = "flattened_bucket",
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> UpdateWeightsResult:
        """Post one bucket: ``serialized_named_tensors`` holds one SGLang payload per
        TP rank (``wire.sglang_payload.tensor_payload``)."""
        if not all(isinstance(p, str) for p in serialized_named_tensors):
            return {
                "success": False,
                "message": "an SGLang engine takes SGLang payloads (wire.sglang_payload); the "
                "trainer sent the embedded engine's handles",
                "num_paused_requests": 0,
            }
        return self._result(
            "tensor update",
            self.client.update_weights_from_tensor,
            serialized_named_tensors,
            weight_version=weight_version,
            flush_cache=flush_cache,
            load_format=load_format,
        )

    @_control
    def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        config_dict: dict[str, Any],
        serialized_named_tensors: list[str],
        load_format: str = "flattened_bucket",
        flush_cache: bool = False,
        expected_checksums: dict[str, str] | None = None,
    ) -> UpdateWeightsResult:
        """Post an adapter: one SGLang payload per TP rank (``wire.sglang_payload``),
        checked by the server against ``expected_checksums`` (sha256 per tensor).
        ``flush_cache`` is accepted: a new adapter shares no cache with the old."""
        if lora_name in self._call("the adapters loaded", self.client.models):
            return {"success": True, "message": f"{lora_name} is loaded", "num_paused_requests": 0}
        return self._result(
            "adapter load",
            self.client.load_lora_adapter_from_tensors,
            lora_name,
            config_dict,
            serialized_named_tensors,
            load_format,
            expected_checksums,
        )

    @_control
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> dict[str, Any]:
        """The server's ranks join trainer rank 0's broadcast group (SGLang needs NCCL)."""
        if backend != "nccl":
            return {"success": False, "message": f"SGLang broadcasts over nccl, not {backend}"}
        reply = self._result(
            "joining a broadcast group",
            self.client.init_weights_update_group,
            master_address,
            master_port,
            rank_offset,
            world_size,
            group_name,
            backend,
        )
        if reply.get("success"):
            self._groups.add(group_name)
        return reply

    @_control
    def has_weights_update_group(self, group_name: str) -> bool:
        return group_name in self._groups

    @_control
    def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        self._groups.discard(group_name)
        return self._result(
            "leaving a broadcast group", self.client.destroy_weights_update_group, group_name
        )

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
        """Receive one bucket as one flat uint8 broadcast (``wire.broadcast_flat``)."""
        return self._result(
            "distributed update",
            self.client.update_weights_from_distributed,
            names,
            dtypes,
            shapes,
            group_name=group_name,
            weight_version=weight_version,
            flush_cache=flush_cache,
            load_format="flattened_bucket",
        )

    @_control
    def update_weight_version(self, new_version: str) -> str:
        self._call("setting the version", self.client.update_weight_version, new_version, False)
        return str(new_version)

    @_control
    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.client.abort_request(rid, abort_all)

    @_control
    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Sleep: free the GPU memory of ``tags`` (all by default). Idempotent, as on the
        embedded engine: SGLang itself fails on a tag it holds released already."""
        wanted = [t for t in (tags or MEMORY_TAGS) if t not in self._released]
        if wanted:
            self._call("release memory", self.client.release_memory_occupation, wanted)
            self._released.update(wanted)
        return self._memory_state(changed=bool(wanted))

    @_control
    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Wake what is released of ``tags`` (all by default). Idempotent: SGLang's
        scheduler dies (KeyError) on resuming a tag it never released (seen on 0.5.17)."""
        wanted = [t for t in (tags or MEMORY_TAGS) if t in self._released]
        if wanted:
            self._call("resume memory", self.client.resume_memory_occupation, wanted)
            self._released.difference_update(wanted)
        return self._memory_state(changed=bool(wanted))

    def _memory_state(self, changed: bool) -> dict[str, Any]:
        state = "asleep" if self._released else "awake"
        return {"success": True, "state": state, "changed": changed, "mode": "sglang"}

    @_control
    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first ``truncate_size`` values of parameter ``name`` as the server holds it."""
        return self._call("reading a weight", self.client.get_weights_by_name, name, truncate_size)
