"""Plumbing of the engine's HTTP server: settings, request parsing, error
bodies and a uvicorn server on a thread.

Owns nothing about engines or routes (``engines.embedded.http_server`` does): a body
is parsed into its pydantic model or a BadRequest that names what is wrong,
and error replies are SGLang's ``ErrorResponse`` shape.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

B = TypeVar("B", bound=BaseModel)


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"  # loopback unless an api_key is set
    port: int = 0  # 0 = a free port
    api_key: str | None = None  # bearer token of the admin endpoints
    allowed_roots: tuple[str, ...] = ()  # dirs /update_weights_from_disk may load from


class BadRequest(Exception):
    """A 4xx with a message, raised by handlers and turned into an ErrorResponse."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def error_response(message: str, status: int) -> JSONResponse:
    phrase = HTTPStatus(status).phrase
    body = {"object": "error", "message": message, "type": phrase, "param": None, "code": status}
    return JSONResponse(body, status_code=status)


async def parse(request: Request, model: type[B]) -> B:
    """The body as ``model``; an empty body is ``{}``. BadRequest names what is wrong."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        errs = e.errors(include_url=False)
        if errs and errs[0]["type"] == "json_invalid":
            raise BadRequest(f"malformed JSON body: {errs[0]['msg']}") from None
        detail = "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}" for err in errs
        )
        raise BadRequest(f"invalid {model.__name__}: {detail}") from None


class HttpServerThread:
    """uvicorn serving an app on a daemon thread; ``url`` once started."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="off", timeout_keep_alive=5
        )
        self.server = uvicorn.Server(config)
        self.host = host
        self.url = ""
        self._thread = threading.Thread(target=self.server.run, name="engine-http", daemon=True)

    def start(self, timeout_s: float = 30.0) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"engine HTTP server did not start on {self.host}")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        self.url = f"http://{host}:{port}"
        return self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
