"""SGLang's HTTP control API, served for an embedded engine.

Owns the HTTP surface of one engine: routes, body validation, status codes,
the admin token and the allowed weight roots (rules in ``engines.security``),
and a uvicorn server on a thread (``serve_in_thread``) so one process, e.g.
the engine's Ray actor, answers both Ray calls and HTTP. Shapes follow SGLang
0.5.x's ``http_server.py``/``io_struct.py`` (see ``engines.types``); the
generate translation is in ``engines.embedded.protocol``. Never loads a file outside
the allowed roots and never returns a token.

Status codes: 400 for a malformed body (bad JSON, unknown field, wrong type,
out-of-range value, a request beyond the model's limits) or a refused
operation (``/flush_cache`` while requests run, a failed or corrupt reload),
401/403 for a missing/wrong admin token, 403 for a cross-origin browser
request to an admin endpoint, for a ``model_path`` (or any file it links to)
outside the allowed roots and for ``/update_weights_from_tensor`` on a server
without a token (its handles must come from the run's actors, over Ray), 415
for an admin body that is not ``application/json``, 503 when unhealthy (the
decode loop died included). Error bodies are
SGLang's ``ErrorResponse``: ``{"object": "error", "message", "type", "param",
"code"}``; weight updates answer ``{success, message, num_paused_requests}``.

Engine calls block, so they run on thread pools: one for generation, a small
one for control, so pause/continue/update are served while every generation
thread waits on a paused engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engines.embedded import protocol
from engines.embedded.http_base import (
    BadRequest,
    HttpServerThread,
    ServerSettings,
    error_response,
    parse,
)
from engines.security import (
    AuthError,
    check_bearer,
    check_browser,
    check_json_body,
    require_token,
    resolve_allowed,
)
from engines.types import (
    AbortRequestBody,
    ContinueGenerationBody,
    DestroyWeightsUpdateGroupBody,
    GenerateBody,
    InitWeightsUpdateGroupBody,
    LoadLoRAAdapterBody,
    MemoryOccupationBody,
    PauseGenerationBody,
    UnloadLoRAAdapterBody,
    UpdateWeightsFromDiskBody,
    UpdateWeightsFromDistributedBody,
    UpdateWeightsFromTensorBody,
    UpdateWeightVersionBody,
    WeightUpdateSessionBody,
)

log = logging.getLogger(__name__)

SERVER_VERSION = "prefect-rl-embedded (SGLang 0.5.x API)"
__all__ = ["HttpServerThread", "ServerSettings", "build_app", "serve_forever", "serve_in_thread"]
NO_TENSOR_OVER_HTTP = (
    "set an api_key to enable /update_weights_from_tensor over HTTP; runs push over Ray"
)


class _Server:
    """Route handlers bound to one engine (an EmbeddedEngine or anything with its methods)."""

    def __init__(self, engine: Any, settings: ServerSettings) -> None:
        require_token(settings.host, settings.api_key)
        self.engine = engine
        self.settings = settings
        self.gen_pool = ThreadPoolExecutor(64, thread_name_prefix="http-generate")
        self.ctl_pool = ThreadPoolExecutor(4, thread_name_prefix="http-control")
        self.update_session = False  # between /begin_weight_update and /end_weight_update

    async def run(self, fn: Callable[..., Any], *args: Any, control: bool = True) -> Any:
        pool = self.ctl_pool if control else self.gen_pool
        return await asyncio.get_running_loop().run_in_executor(pool, lambda: fn(*args))

    async def admin(self, request: Request) -> None:
        """The token, then no cross-origin browser, then a JSON body (security)."""
        check_bearer(request.headers.get("authorization"), self.settings.api_key)
        check_browser(dict(request.headers), self.settings.host)
        check_json_body(request.headers.get("content-type"), await request.body())

    # ---- generation and info ---------------------------------------------

    async def generate(self, request: Request) -> Any:
        body = await parse(request, GenerateBody)
        try:
            return await self.run(protocol.generate, body, self.engine, control=False)
        except ValueError as e:
            raise BadRequest(str(e)) from None

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def health_generate(self, request: Request) -> Response:
        ok = await self.run(self.engine.health_generate)
        return Response(status_code=200 if ok else 503)

    async def model_info(self, request: Request) -> dict:
        info = await self.run(self.engine.model_info)
        return {
            "model_path": info["model_path"],
            "tokenizer_path": info["tokenizer_path"],
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": info["weight_version"],
            "has_image_understanding": False,
            "has_audio_understanding": False,
            **{k: v for k, v in info.items() if k not in ("is_generation",)},
        }

    async def server_info(self, request: Request) -> dict:
        info = await self.run(self.engine.model_info)
        load = await self.run(self.engine.get_load)
        return {
            "model_path": info["model_path"],
            "host": self.settings.host,
            "port": self.settings.port,
            "weight_version": info["weight_version"],
            "tp_size": 1,
            "internal_states": [dict(load, paused=info.get("paused", False))],
            "version": SERVER_VERSION,
        }

    async def get_load(self, request: Request) -> list[dict]:
        load = await self.run(self.engine.get_load)
        running, waiting = load["num_running_reqs"], load["num_waiting_reqs"]
        return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting}]

    # ---- admin -----------------------------------------------------------

    async def update_weights_from_disk(self, request: Request) -> JSONResponse:
        await self.admin(request)
        body = await parse(request, UpdateWeightsFromDiskBody)
        try:
            path = resolve_allowed(body.model_path, self.settings.allowed_roots)
        except PermissionError as e:
            reply = {"success": False, "message": str(e), "num_paused_requests": 0}
            return JSONResponse(reply, status_code=403)
        try:
            res = await self.run(
                lambda: self.engine.update_weights_from_disk(
                    path,
                    body.weight_version,
                    body.flush_cache,
                    body.abort_all_requests,
                    allowed_roots=self.settings.allowed_roots,
                )
            )
        except PermissionError as e:  # wire.errors.WeightPathError: a file escapes
            reply = {"success": False, "message": str(e), "num_paused_requests": 0}
            return JSONResponse(reply, status_code=403)
        return JSONResponse(res, status_code=200 if res["success"] else 400)

    async def load_lora_adapter(self, request: Request) -> JSONResponse:
        await self.admin(request)
        body = await parse(request, LoadLoRAAdapterBody)
        try:
            path = resolve_allowed(body.lora_path, self.settings.allowed_roots)
            res = await self.run(
                lambda: self.engine.load_lora_adapter(
                    body.lora_name, path, allowed_roots=self.settings.allowed_roots
                )
            )
        except PermissionError as e:  # outside the roots, or a file escapes them
            reply = {"success": False, "message": str(e), "num_paused_requests": 0}
            return JSONResponse(reply, status_code=403)
        except ValueError as e:  # a lora_name that names no version
            raise BadRequest(str(e)) from None
        return JSONResponse(res, status_code=200 if res["success"] else 400)

    async def unload_lora_adapter(self, request: Request) -> dict:
        await self.admin(request)
        body = await parse(request, UnloadLoRAAdapterBody)
        return await self.run(self.engine.unload_lora_adapter, body.lora_name)

    async def models(self, request: Request) -> dict:
        """OpenAI's model list as SGLang fills it: the base, then the adapter served."""
        info = await self.run(self.engine.model_info)
        cards = [{"id": info["model_path"], "object": "model", "root": info["model_path"]}]
        if info.get("lora_name"):
            cards.append({"id": info["lora_name"], "object": "model", "parent": cards[0]["id"]})
        return {"object": "list", "data": cards}

    async def update_weight_version(self, request: Request) -> dict:
        await self.admin(request)
        body = await parse(request, UpdateWeightVersionBody)
        if body.abort_all_requests:
            await self.run(lambda: self.engine.abort_request(abort_all=True))
        await self.run(self.engine.update_weight_version, body.new_version)
        msg = f"Weight version updated to {body.new_version}"
        return {"success": True, "message": msg, "new_version": body.new_version}

    async def pause_generation(self, request: Request) -> dict:
        await self.admin(request)
        body = await parse(request, PauseGenerationBody)
        await self.run(self.engine.pause_generation, body.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    async def continue_generation(self, request: Request) -> dict:
        await self.admin(request)
        await parse(request, ContinueGenerationBody)
        await self.run(self.engine.continue_generation)
        return {"message": "Generation continued successfully.", "status": "ok"}

    async def flush_cache(self, request: Request) -> Response:
        await self.admin(request)
        if await self.run(self.engine.flush_cache):
            return Response("Cache flushed.\n", status_code=200)
        raise BadRequest(
            "Cache not flushed: requests are running or waiting; pause with abort first"
        )

    async def abort_request(self, request: Request) -> Response:
        await self.admin(request)
        body = await parse(request, AbortRequestBody)
        await self.run(lambda: self.engine.abort_request(rid=body.rid, abort_all=body.abort_all))
        return Response(status_code=200)

    async def release_memory_occupation(self, request: Request) -> dict:
        await self.admin(request)
        body = await parse(request, MemoryOccupationBody)
        return await self.run(self.engine.release_memory_occupation, body.tags)

    async def resume_memory_occupation(self, request: Request) -> dict:
        await self.admin(request)
        body = await parse(request, MemoryOccupationBody)
        return await self.run(self.engine.resume_memory_occupation, body.tags)

    async def update_weights_from_tensor(self, request: Request) -> JSONResponse:
        await self.admin(request)
        if not self.settings.api_key:  # handles must come from the run's own actors
            raise BadRequest(NO_TENSOR_OVER_HTTP, status=403)
        body = await parse(request, UpdateWeightsFromTensorBody)
        from wire.receiver import decode_handle  # torch: only when used

        try:
            handles = [decode_handle(h) for h in body.serialized_named_tensors]
        except ValueError as e:  # not a bucket handle (wire.safe_pickle)
            raise BadRequest(str(e)) from None
        if body.abort_all_requests:
            await self.run(lambda: self.engine.abort_request(abort_all=True))
        res = await self.run(
            lambda: self.engine.update_weights_from_tensor(
                handles,
                body.load_format or "flattened_bucket",
                body.flush_cache,
                body.weight_version,
            )
        )
        return JSONResponse(res, status_code=200 if res["success"] else 400)

    async def init_weights_update_group(self, request: Request) -> dict:
        await self.admin(request)
        b = await parse(request, InitWeightsUpdateGroupBody)
        args = (
            b.master_address,
            b.master_port,
            b.rank_offset,
            b.world_size,
            b.group_name,
            b.backend,
        )
        return await self.run(self.engine.init_weights_update_group, *args)

    async def update_weights_from_distributed(self, request: Request) -> JSONResponse:
        await self.admin(request)
        b = await parse(request, UpdateWeightsFromDistributedBody)
        if b.abort_all_requests:
            await self.run(lambda: self.engine.abort_request(abort_all=True))
        res = await self.run(
            lambda: self.engine.update_weights_from_distributed(
                b.names, b.dtypes, b.shapes, b.group_name, b.flush_cache, b.weight_version
            )
        )
        return JSONResponse(res, status_code=200 if res["success"] else 400)

    async def destroy_weights_update_group(self, request: Request) -> dict:
        await self.admin(request)
        b = await parse(request, DestroyWeightsUpdateGroupBody)
        return await self.run(self.engine.destroy_weights_update_group, b.group_name)

    async def begin_weight_update(self, request: Request) -> dict:
        """Open a weight-update session (SGLang 0.5.23); a no-op bracket for this engine."""
        await self.admin(request)
        await parse(request, WeightUpdateSessionBody)
        if self.update_session:
            raise BadRequest("a weight update is already in progress: call /end_weight_update")
        self.update_session = True
        return {"success": True, "message": "weight update begun"}

    async def end_weight_update(self, request: Request) -> dict:
        await self.admin(request)
        await parse(request, WeightUpdateSessionBody)
        if not self.update_session:
            raise BadRequest("no weight update in progress: call /begin_weight_update first")
        self.update_session = False
        return {"success": True, "message": "weight update ended"}


ROUTES: list[tuple[str, tuple[str, ...], str]] = [
    ("/generate", ("POST", "PUT"), "generate"),
    ("/health", ("GET",), "health"),
    ("/health_generate", ("GET",), "health_generate"),
    ("/model_info", ("GET",), "model_info"),
    ("/get_model_info", ("GET",), "model_info"),
    ("/server_info", ("GET",), "server_info"),
    ("/get_server_info", ("GET",), "server_info"),
    ("/get_load", ("GET",), "get_load"),
    ("/update_weights_from_disk", ("POST",), "update_weights_from_disk"),
    ("/update_weight_version", ("POST",), "update_weight_version"),
    ("/load_lora_adapter", ("POST",), "load_lora_adapter"),
    ("/unload_lora_adapter", ("POST",), "unload_lora_adapter"),
    ("/v1/models", ("GET",), "models"),
    ("/pause_generation", ("POST",), "pause_generation"),
    ("/continue_generation", ("POST",), "continue_generation"),
    ("/flush_cache", ("GET", "POST"), "flush_cache"),
    ("/abort_request", ("POST",), "abort_request"),
    ("/release_memory_occupation", ("GET", "POST"), "release_memory_occupation"),
    ("/resume_memory_occupation", ("GET", "POST"), "resume_memory_occupation"),
    ("/update_weights_from_tensor", ("POST",), "update_weights_from_tensor"),
    ("/init_weights_update_group", ("POST",), "init_weights_update_group"),
    ("/update_weights_from_distributed", ("POST",), "update_weights_from_distributed"),
    ("/destroy_weights_update_group", ("POST",), "destroy_weights_update_group"),
    ("/begin_weight_update", ("POST",), "begin_weight_update"),
    ("/end_weight_update", ("POST",), "end_weight_update"),
]


def build_app(engine: Any, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving ``engine``; raises ValueError for an unsafe binding."""
    server = _Server(engine, settings)
    app = FastAPI(title="prefect-rl engine", openapi_url=None)
    app.state.server = server
    for path, methods, name in ROUTES:
        app.add_api_route(path, getattr(server, name), methods=list(methods))

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest) -> JSONResponse:
        return error_response(str(exc), exc.status)

    @app.exception_handler(AuthError)
    async def _auth(request: Request, exc: AuthError) -> JSONResponse:
        return error_response(str(exc), exc.status)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("engine http: %s failed", request.url.path)
        return error_response(f"{type(exc).__name__}: {exc}", 500)

    return app


def serve_in_thread(engine: Any, settings: ServerSettings) -> HttpServerThread:
    """Start serving ``engine`` on a thread of this process; returns once it listens."""
    thread = HttpServerThread(build_app(engine, settings), settings.host, settings.port)
    thread.start()
    log.info("engine HTTP API at %s", thread.url)
    return thread


class _AbortingServer(uvicorn.Server):
    """uvicorn that aborts the engine's requests when it shuts down: a generate
    waiting on the engine must not keep SIGTERM from stopping the process."""

    def __init__(self, config: uvicorn.Config, engine: Any) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: Any = None) -> None:
        try:
            await asyncio.to_thread(lambda: self.engine.abort_request(abort_all=True))
        except Exception:  # a broken engine must not block the shutdown either
            log.exception("engine http: abort at shutdown failed")
        await super().shutdown(sockets)


def serve_forever(engine: Any, settings: ServerSettings) -> None:
    """Serve ``engine`` in the foreground until SIGINT/SIGTERM (``prefect-rl serve-engine``)."""
    app = build_app(engine, settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        timeout_keep_alive=5,
        timeout_graceful_shutdown=10,
    )
    _AbortingServer(config, engine).run()
