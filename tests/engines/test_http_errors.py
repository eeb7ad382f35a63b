"""Bad requests, the admin token and the allowed weight roots of the embedded server.

Each bad request gets a 4xx with a message and the server keeps serving.
"""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from engines.client import EngineClient, EngineHTTPError
from engines.config import EngineConfig
from engines.embedded.engine import EmbeddedEngine
from engines.embedded.http_server import HttpServerThread, ServerSettings, serve_in_thread

TOKEN = "s3cret-token"
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return EmbeddedEngine(str(tiny_dir), 0, EngineConfig(), weight_version=0)


@pytest.fixture(scope="module")
def url(engine, tiny_v1):
    thread = serve_in_thread(engine, ServerSettings(allowed_roots=(str(tiny_v1),)))
    yield thread.url
    thread.stop()


BAD_GENERATE = {
    "malformed JSON": b'{"input_ids": [1, 2',
    "unknown field": b'{"input_ids": [1, 2], "temprature": 0.5}',
    "unknown sampling key": b'{"input_ids": [1, 2], "sampling_params": {"temprature": 0.5}}',
    "wrong type": b'{"input_ids": "1 2 3"}',
    "wrong sampling type": b'{"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}}',
    "negative max_new_tokens": b'{"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}',
    "top_k zero": b'{"input_ids": [1], "sampling_params": {"top_k": 0}}',
    "no prompt": b'{"sampling_params": {}}',
    "both prompts": b'{"text": "a", "input_ids": [1]}',
    "empty prompt": b'{"input_ids": []}',
    "stream": b'{"input_ids": [1], "stream": true}',
    "mismatched batch": b'{"input_ids": [[1], [2]], "sampling_params": [{}]}',
    "huge n": b'{"input_ids": [1], "sampling_params": {"n": 100000000}}',
}


@pytest.mark.parametrize("case", sorted(BAD_GENERATE))
def test_bad_generate_is_400_and_server_keeps_serving(url, case):
    r = httpx.post(f"{url}/generate", content=BAD_GENERATE[case])
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["code"] == 400 and body["message"]
    assert httpx.get(f"{url}/health_generate").status_code == 200


BAD_CONTROL = [
    ("/pause_generation", b'{"mode": "sideways"}'),
    ("/update_weight_version", b"{}"),  # new_version is required
    ("/update_weights_from_disk", b'{"model_path": 5}'),
    ("/abort_request", b'{"rid": "x", "abort_al": true}'),
    ("/release_memory_occupation", b'{"tags": "weights"}'),
    ("/continue_generation", b"[1"),
]


@pytest.mark.parametrize("path,body", BAD_CONTROL)
def test_bad_control_body_is_400(url, path, body):
    r = httpx.post(f"{url}{path}", content=body, headers=JSON)
    assert r.status_code == 400 and r.json()["message"], r.text
    assert httpx.get(f"{url}/model_info").json()["weight_version"] == "0"


def test_model_path_outside_allowed_roots_is_refused(url, tiny_v1, tiny_dir, tmp_path):
    client = EngineClient(url, retries=0)
    outside = [str(tmp_path), "/etc", f"{tiny_v1}/../../..", str(tiny_dir) + "-not"]
    for path in outside:
        with pytest.raises(EngineHTTPError) as e:
            client.update_weights_from_disk(path, weight_version="9")
        assert e.value.status == 403 and "allowed roots" in e.value.message
    link = tmp_path / "link"
    link.symlink_to("/etc")
    with pytest.raises(EngineHTTPError):
        client.update_weights_from_disk(str(link))
    assert client.get_weight_version() == "0" and client.health_generate()


def test_admin_token_required_off_loopback(engine):
    with pytest.raises(ValueError, match="api key"):
        serve_in_thread(engine, ServerSettings(host="0.0.0.0"))
    thread = serve_in_thread(engine, ServerSettings(host="0.0.0.0", api_key=TOKEN))
    try:
        url = thread.url
        assert httpx.post(f"{url}/pause_generation", json={"mode": "abort"}).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        r = httpx.post(f"{url}/update_weight_version", json={"new_version": "3"}, headers=wrong)
        assert r.status_code == 403 and TOKEN not in r.text
        assert httpx.post(f"{url}/flush_cache").status_code == 401
        assert httpx.post(f"{url}/release_memory_occupation", json={}).status_code == 401
        # Generation and info stay open; with the token, admin calls work.
        short = {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 8}}
        assert httpx.post(f"{url}/generate", json=short).status_code == 200
        with EngineClient(url, api_key=TOKEN) as admin:
            assert admin.flush_cache() and admin.get_weight_version() == "0"
    finally:
        thread.stop()


def test_client_retries_transient_errors_only():
    calls = {"flaky": 0}
    app = FastAPI()

    @app.get("/model_info")
    async def flaky():
        calls["flaky"] += 1
        if calls["flaky"] < 3:
            return JSONResponse({"message": "warming up"}, status_code=503)
        return {"weight_version": "4"}

    @app.post("/generate")
    async def bad():
        calls["bad"] = calls.get("bad", 0) + 1
        return JSONResponse({"error": {"message": "nope"}}, status_code=400)

    thread = HttpServerThread(app, "127.0.0.1", 0)
    url = thread.start()
    try:
        client = EngineClient(url, retries=3, backoff_s=0.01)
        assert client.get_weight_version() == "4" and calls["flaky"] == 3
        with pytest.raises(EngineHTTPError) as e:
            client.generate(input_ids=[1])
        assert (e.value.status, e.value.message, calls["bad"]) == (400, "nope", 1)
    finally:
        thread.stop()
    dead = EngineClient(url, retries=1, backoff_s=0.01, connect_timeout_s=1)
    with pytest.raises(EngineHTTPError) as e:
        dead.model_info()
    assert e.value.status == 0
    assert dead.health() is False


def test_a_server_that_resets_the_connection_is_unreachable_not_a_crash():
    """A server process dying mid-reply resets the connection (as a killed engine's
    does): the caller gets EngineHTTPError (status 0), which the rollout retries on
    another engine, not httpx's own error."""
    import socket
    import struct
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]

    def reset_each() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(65536)  # the request arrived; the process dies before it answers
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # linger 0: RST, "connection reset by peer" at the client

    threading.Thread(target=reset_each, daemon=True).start()
    try:
        with EngineClient(f"http://127.0.0.1:{port}", retries=1, backoff_s=0.01) as client:
            with pytest.raises(EngineHTTPError) as e:
                client.model_info()
        assert e.value.status == 0 and "unreachable" in e.value.message
    finally:
        listener.close()
