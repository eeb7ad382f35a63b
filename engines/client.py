"""The one HTTP client of a rollout engine: an SGLang server or the embedded one.

Owns how prefect-rl talks to an engine over HTTP: timeouts, bounded retries
on transient failures, the admin bearer token and turning error replies into
``EngineHTTPError``. Methods mirror SGLang 0.5.x endpoints and send SGLang's
request bodies; replies are returned as SGLang shapes them. Retries cover
only failures where the request cannot have run: connection errors and 502,
503 and 504 replies; a read timeout is never retried (a generation may be
running). The weight version is read from ``/model_info`` (newer SGLang
removed ``/get_weight_version``).

``deadline_s`` bounds each call as a whole (retries and their backoff
included; the step's deadline, ``tasks.timeout_s``): past it the call raises
``TimeoutError`` naming the engine's URL and the endpoint, and so does a reply
slower than the read timeout.
"""

from __future__ import annotations

import functools
import ssl
import time
from typing import Any

import httpx

RETRY_STATUS = (502, 503, 504)
DEADLINE = "the step's deadline, tasks.timeout_s"


class EngineHTTPError(RuntimeError):
    """The engine answered ``status`` with ``message`` (or could not be reached: status 0)."""

    def __init__(self, status: int, message: str, path: str) -> None:
        super().__init__(f"{path}: HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.path = path


def _message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip() or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "error_message", "detail"):
            if key in body:
                return str(body[key])
    return str(body)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default TLS context (certifi's CAs, or SSL_CERT_FILE / SSL_CERT_DIR), built
    once per process: building it costs ~27 ms of CPU, and a client is made for every
    reload and verify of every engine (a context is safe to share between clients)."""
    return httpx.create_ssl_context()


class EngineClient:
    """Synchronous client of one engine at ``base_url``; thread-safe (one httpx pool)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        deadline_s: float | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            verify=_tls_context(),
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- transport --------------------------------------------------------

    def request(self, method: str, path: str, json: Any = None) -> httpx.Response:
        """Send with bounded retries on transient errors; raise EngineHTTPError on a 4xx/5xx,
        TimeoutError past the read timeout or ``deadline_s``."""
        end = None if self.deadline_s is None else time.monotonic() + self.deadline_s
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            kwargs: dict[str, Any] = {}
            if end is not None:
                left = end - time.monotonic()
                if left <= 0:
                    raise self._timeout(method, path, self.deadline_s, DEADLINE)
                # httpx times each read, not the whole call: cap it by what is left
                kwargs["timeout"] = httpx.Timeout(min(self.timeout_s, left), connect=min(5.0, left))
            try:
                resp = self._http.request(method, path, json=json, **kwargs)
            # A server that is not there, or that dies mid-reply (its connection closed or
            # reset): the same for every caller, retried as far as it allows.
            except (
                httpx.ConnectError,
                httpx.ConnectTimeout,
                httpx.RemoteProtocolError,
                httpx.ReadError,
                httpx.WriteError,
            ) as e:
                if last:
                    raise EngineHTTPError(0, f"unreachable: {e}", path) from e
            except httpx.TimeoutException:  # never retried: the request may be running
                if end is not None and self.deadline_s <= self.timeout_s:
                    raise self._timeout(method, path, self.deadline_s, DEADLINE) from None
                raise self._timeout(
                    method, path, self.timeout_s, "the client's read timeout"
                ) from None
            else:
                if resp.status_code not in RETRY_STATUS or last:
                    if resp.status_code >= 400:
                        raise EngineHTTPError(resp.status_code, _message(resp), path)
                    return resp
            pause = self.backoff_s * 2**attempt
            if end is not None:
                pause = min(pause, max(0.0, end - time.monotonic()))
            time.sleep(pause)
        raise AssertionError("unreachable")

    def _timeout(self, method: str, path: str, seconds: float, why: str) -> TimeoutError:
        return TimeoutError(
            f"engine at {self.base_url}: {method} {path} did not answer within {seconds:g}s "
            f"({why}); the engine may be paused or stuck: check its /health_generate"
        )

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        resp = self.request(method, path, body)
        return resp.json() if resp.content else None

    # ---- generation and info ----------------------------------------------

    def generate(
        self,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict | list[dict] | None = None,
        return_logprob: bool | list[bool] = False,
        text: str | list[str] | None = None,
        rid: str | list[str] | None = None,
        lora_path: str | None = None,
    ) -> dict | list[dict]:
        """``/generate``: a dict for one prompt (n=1), else a list in prompt-major order.
        ``lora_path``: the name of the adapter every prompt samples from."""
        body: dict[str, Any] = {"return_logprob": return_logprob}
        if input_ids is not None:
            body["input_ids"] = input_ids
        if text is not None:
            body["text"] = text
        if sampling_params is not None:
            body["sampling_params"] = sampling_params
        if rid is not None:
            body["rid"] = rid
        if lora_path is not None:
            body["lora_path"] = lora_path
        return self._json("POST", "/generate", body)

    def health(self) -> bool:
        """``/health``: True if the server answers 200 (no retries beyond the transport's)."""
        return self._ok("/health")

    def health_generate(self) -> bool:
        """``/health_generate``: True if a 1-token generation succeeded."""
        return self._ok("/health_generate")

    def _ok(self, path: str) -> bool:
        try:
            self.request("GET", path)
        except EngineHTTPError:
            return False
        return True

    def model_info(self) -> dict:
        return self._json("GET", "/model_info")

    def server_info(self) -> dict:
        return self._json("GET", "/server_info")

    def get_weight_version(self) -> str:
        """The served version, from ``/model_info``."""
        return str(self.model_info()["weight_version"])

    # ---- admin --------------------------------------------------------------

    def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict:
        """``{success, message, num_paused_requests}``; a refused load raises EngineHTTPError."""
        body: dict[str, Any] = {
            "model_path": model_path,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return self._json("POST", "/update_weights_from_disk", body)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """Serve the peft folder ``lora_path`` as adapter ``lora_name``; a refused load
        raises EngineHTTPError."""
        body = {"lora_name": lora_name, "lora_path": lora_path}
        return self._json("POST", "/load_lora_adapter", body)

    def unload_lora_adapter(self, lora_name: str) -> dict:
        return self._json("POST", "/unload_lora_adapter", {"lora_name": lora_name})

    def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        config_dict: dict[str, Any],
        serialized_named_tensors: list[str],
        load_format: str = "flattened_bucket",
        expected_checksums: dict[str, str] | None = None,
    ) -> dict:
        """An adapter's tensors as one payload per TP rank (``wire.sglang_payload``);
        ``expected_checksums``: sha256 of each tensor's bytes, checked by the server."""
        body: dict[str, Any] = {
            "lora_name": lora_name,
            "config_dict": config_dict,
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
        }
        if expected_checksums is not None:
            body["expected_checksums"] = expected_checksums
        return self._json("POST", "/load_lora_adapter_from_tensors", body)

    def models(self) -> list[str]:
        """The ids ``/v1/models`` lists: the base model's, then each loaded adapter's."""
        return [str(card["id"]) for card in self._json("GET", "/v1/models")["data"]]

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> dict:
        body = {"new_version": str(new_version), "abort_all_requests": abort_all_requests}
        return self._json("POST", "/update_weight_version", body)

    def pause_generation(self, mode: str = "abort") -> dict:
        return self._json("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self, torch_empty_cache: bool = True) -> dict:
        """Resume. ``torch_empty_cache`` (SGLang's default, True): the server's scheduler
        returns its allocator's cached blocks to the driver first, which the next
        batch then allocates again; the embedded engine ignores it."""
        return self._json("POST", "/continue_generation", {"torch_empty_cache": torch_empty_cache})

    def flush_cache(self) -> bool:
        """True if flushed; False if refused because requests are running (SGLang's 400)."""
        try:
            self.request("POST", "/flush_cache")
        except EngineHTTPError as e:
            if e.status == 400:
                return False
            raise
        return True

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return self._json("POST", "/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return self._json("POST", "/resume_memory_occupation", {"tags": tags})

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        weight_version: str | None = None,
        flush_cache: bool = True,
        load_format: str = "flattened_bucket",
    ) -> dict:
        """Buckets as base64 handles (``wire.receiver.encode_handle``)."""
        body: dict[str, Any] = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return self._json("POST", "/update_weights_from_tensor", body)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> dict:
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return self._json("POST", "/init_weights_update_group", body)

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> dict:
        """One bucket by broadcast; ``load_format: flattened_bucket`` (SGLang) receives it
        as one flat uint8 tensor in the order named."""
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return self._json("POST", "/update_weights_from_distributed", body)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first ``truncate_size`` values of parameter ``name``, as the server holds it."""
        return self._json(
            "POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size}
        )

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self._json("POST", "/destroy_weights_update_group", {"group_name": group_name})

    def begin_weight_update(self) -> Any:
        return self._json("POST", "/begin_weight_update", {})

    def end_weight_update(self) -> Any:
        return self._json("POST", "/end_weight_update", {})
