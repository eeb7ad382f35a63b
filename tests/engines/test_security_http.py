"""No request data is unpickled outside the allow-list, and
a web page cannot drive a loopback engine's admin endpoints.

Real uvicorn servers on loopback and real HTTP requests; the "attacks" are
the requests an attacker would send.
"""

from __future__ import annotations

import base64
import os
import pickle

import httpx
import pytest
import torch

from engines.config import EngineConfig
from engines.embedded.engine import EmbeddedEngine
from engines.embedded.http_server import NO_TENSOR_OVER_HTTP, ServerSettings, serve_in_thread
from training.weight_sender import ShmSegment
from wire import receiver as wr
from wire.flat_bucket import TensorMeta, flatten
from wire.safe_pickle import UnsafePickleError, safe_loads

TOKEN = "sec-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json"}


class _MakesDir:
    """A pickle that runs os.mkdir(path) when loaded: stands for any code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _evil(marker) -> str:
    return base64.b64encode(pickle.dumps({"kind": "shm", "x": _MakesDir(str(marker))})).decode()


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return EmbeddedEngine(str(tiny_dir), 0, EngineConfig(), weight_version=0)


@pytest.fixture(scope="module")
def open_url(engine):
    thread = serve_in_thread(engine, ServerSettings())
    yield thread.url
    thread.stop()


@pytest.fixture(scope="module")
def token_url(engine):
    thread = serve_in_thread(engine, ServerSettings(api_key=TOKEN))
    yield thread.url
    thread.stop()


def _tensor_post(url: str, handles: list[str], headers: dict | None = None) -> httpx.Response:
    body = {"serialized_named_tensors": handles}
    return httpx.post(f"{url}/update_weights_from_tensor", json=body, headers=headers or {})


def test_tensor_endpoint_without_a_token_is_refused_before_unpickling(open_url, tmp_path):
    marker = tmp_path / "pwned"
    r = _tensor_post(open_url, [_evil(marker)])
    assert r.status_code == 403 and r.json()["message"] == NO_TENSOR_OVER_HTTP
    assert not marker.exists()
    assert httpx.get(f"{open_url}/model_info").json()["weight_version"] == "0"


def test_tensor_endpoint_with_a_token_never_runs_a_pickle(token_url, tmp_path, engine):
    marker = tmp_path / "pwned"
    r = _tensor_post(token_url, [_evil(marker)], BEARER)
    assert r.status_code == 400 and "refused to unpickle" in r.json()["message"]
    assert not marker.exists()
    # A well-formed handle that maps a file other than a producer segment is refused too.
    other = tmp_path / "secret.bin"
    other.write_bytes(b"\0" * 64)
    meta = [TensorMeta("model.norm.weight", (16,), "float32", 0, 16, 16)]
    fake = {
        "kind": "shm",
        "path": str(other),
        "nbytes": 64,
        "parts": [{"offset": 0, "metadata": meta}],
    }
    r = _tensor_post(token_url, [wr.encode_handle(fake)], BEARER)
    assert r.status_code == 400 and "not a producer segment" in r.json()["message"]
    assert _tensor_post(token_url, ["%%%"], BEARER).status_code == 400  # not even base64
    before = engine.state_sha256()
    # A real bucket still goes through (the allow-list holds what a bucket needs).
    state = engine.served.model.state_dict()
    seg = ShmSegment(flatten([("model.norm.weight", state["model.norm.weight"].clone())]))
    try:
        r = _tensor_post(token_url, [wr.encode_handle(seg.handle)], BEARER)
    finally:
        seg.close()
    assert r.status_code == 200 and r.json()["success"], r.text
    assert engine.state_sha256() == before  # same tensor copied back: nothing else moved


def test_cuda_ipc_handles_over_ray_go_through_the_allow_list(tmp_path):
    marker = tmp_path / "pwned"
    meta = [TensorMeta("w", (1,), "float32", 0, 1, 1)]
    handle = {
        "kind": "cuda_ipc",
        "parts": [{"handle": pickle.dumps(_MakesDir(str(marker))), "metadata": meta}],
    }
    with pytest.raises(UnsafePickleError, match="refused to unpickle"):
        wr.open_bucket(handle, torch.device("cpu"))
    assert not marker.exists()
    # The globals ForkingPickler writes for a CUDA tensor are the ones allowed.
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    made = (rebuild_cuda_tensor, torch.Tensor, torch.Size([2, 3]), torch.storage.TypedStorage)
    assert safe_loads(pickle.dumps((*made, torch.bfloat16, torch.float32))) == (
        *made,
        torch.bfloat16,
        torch.float32,
    )
    for bad in (eval, getattr, os.system, __import__):
        with pytest.raises(UnsafePickleError):
            safe_loads(pickle.dumps(bad))


def _paused(url: str) -> bool:
    return httpx.get(f"{url}/server_info").json()["internal_states"][0]["paused"]


BROWSER_ATTACKS = {
    "text/plain simple request": {"Content-Type": "text/plain"},
    "form post": {"Content-Type": "application/x-www-form-urlencoded"},
    "cross-origin JSON": {"Origin": "http://evil.example", **JSON},
    "cross-origin text/plain": {"Origin": "http://evil.example", "Content-Type": "text/plain"},
    "opaque origin": {"Origin": "null", **JSON},
    "other localhost port": {"Origin": "http://127.0.0.1:1", **JSON},
    "sec-fetch-site cross-site": {"Sec-Fetch-Site": "cross-site", **JSON},
    "sec-fetch-site same-site": {"Sec-Fetch-Site": "same-site", **JSON},
    "dns rebinding": {"Host": "evil.example", **JSON},
}


@pytest.mark.parametrize("case", sorted(BROWSER_ATTACKS))
def test_browser_requests_cannot_pause_a_loopback_engine(open_url, case):
    headers = BROWSER_ATTACKS[case]
    r = httpx.post(f"{open_url}/pause_generation", content=b'{"mode": "abort"}', headers=headers)
    assert r.status_code in (403, 415) and r.json()["message"], r.text
    assert not _paused(open_url)
    r = httpx.post(
        f"{open_url}/update_weight_version", content=b'{"new_version": "7"}', headers=headers
    )
    assert r.status_code in (403, 415)
    assert httpx.get(f"{open_url}/model_info").json()["weight_version"] == "0"


def test_programs_and_same_origin_pages_still_drive_it(open_url):
    same = {"Origin": open_url, "Sec-Fetch-Site": "same-origin", **JSON}
    r = httpx.post(f"{open_url}/pause_generation", content=b'{"mode": "abort"}', headers=same)
    assert r.status_code == 200 and _paused(open_url)
    r = httpx.post(f"{open_url}/continue_generation", json={})  # what EngineClient sends
    assert r.status_code == 200 and not _paused(open_url)
    assert httpx.post(f"{open_url}/flush_cache").status_code == 200  # no body, no type
