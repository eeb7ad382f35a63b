"""The HTTP contract: engines.client against the embedded server over real HTTP, and
the same tests against a real SGLang server on a CUDA machine (``-m "gpu and sglang"``).

Request bodies are SGLang 0.5.x's (``io_struct``); the server runs in this
process on a uvicorn thread, as it does inside the engine actor (the actor
path itself is in test_http_launcher.py). Tests run in file order and each
leaves the engine unpaused and serving the tiny model.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engines.client import EngineClient, EngineHTTPError
from engines.config import EngineConfig
from engines.embedded.engine import EmbeddedEngine
from engines.embedded.http_server import ServerSettings, serve_in_thread

PROMPT = [1, 5, 6, 7, 25, 8]
ROWS = 4
LONG = {"temperature": 1.0, "max_new_tokens": 400, "ignore_eos": True, "n": ROWS}


SGLANG = pytest.param("sglang", marks=[pytest.mark.gpu, pytest.mark.sglang])


@pytest.fixture(scope="module", params=["embedded", SGLANG])
def server(request, tiny_dir, tiny_v1, broken_dir, tmp_path_factory):
    """The embedded engine's server, or (``-m "gpu and sglang"`` on a CUDA machine with
    ``PREFECT_RL_SGLANG_SITE``) a real SGLang server of the same tiny model."""
    if request.param == "sglang":
        yield from _sglang_server(tiny_dir, tmp_path_factory.mktemp("sglang-logs"))
        return
    # context_length: past the tiny model's 64 positions, for long generations to pause.
    engine = EmbeddedEngine(str(tiny_dir), 0, EngineConfig(context_length=1024), weight_version=0)
    roots = (str(tiny_dir), str(tiny_v1), str(broken_dir))
    thread = serve_in_thread(engine, ServerSettings(allowed_roots=roots))
    yield thread.url
    thread.stop()


def _sglang_server(tiny_dir, log_dir):
    import os

    import torch

    from engines.config import SGLangConfig
    from engines.sglang.engine import SGLangEngine

    site = os.environ.get("PREFECT_RL_SGLANG_SITE")
    if not torch.cuda.is_available() or not site:
        pytest.skip("needs CUDA and PREFECT_RL_SGLANG_SITE")
    os.environ["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"  # past the 64 positions
    args = ["--attention-backend", "triton", "--sampling-backend", "pytorch"]
    args += ["--disable-cuda-graph", "--skip-server-warmup", "--context-length", "1024"]
    args += ["--enable-memory-saver"]
    sc = SGLangConfig(
        pythonpath=[site], extra_args=args, mem_fraction_static=0.2, log_dir=str(log_dir)
    )
    engine = SGLangEngine(str(tiny_dir), 0, EngineConfig(kind="sglang", sglang=sc))
    try:
        yield engine.url
    finally:
        engine.stop()


@pytest.fixture
def kind(request, server) -> str:
    """Which server the module runs against: ``embedded`` or ``sglang``."""
    return request.node.callspec.params["server"]


@pytest.fixture(scope="module")
def client(server):
    with EngineClient(server, timeout_s=60, retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(4) as p:
        yield p


def _long(pool, client, seed: int = 0):
    params = dict(LONG, sampling_seed=seed)
    return pool.submit(
        client.generate, input_ids=PROMPT, sampling_params=params, return_logprob=True
    )


def _running(client) -> int:
    """Requests decoding now, from ``/get_load`` (SGLang's ``server_info`` has no count)."""
    load = client.request("GET", "/get_load").json()
    return sum(d["num_reqs"] - d.get("num_waiting_reqs", 0) for d in load)


def _wait_running(client) -> None:
    deadline = time.monotonic() + 30
    while _running(client) == 0:
        assert time.monotonic() < deadline, "generation never started"
        time.sleep(0.01)


def test_generate_single_and_batch_shapes(client, kind):
    r = client.generate(
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 6, "temperature": 0},
        return_logprob=True,
    )
    assert isinstance(r, dict) and set(r) == {"text", "output_ids", "meta_info"}
    meta = r["meta_info"]
    assert meta["weight_version"] == "0"
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["completion_tokens"] == len(r["output_ids"]) >= 1
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == r["output_ids"] and all(x is None for _, _, x in lps)
    assert all(lp <= 0 for lp, _, _ in lps)
    # A batch with per-prompt return_logprob (SGLang refuses a list with n > 1).
    mixed = client.generate(
        input_ids=[PROMPT, [1, 5]],
        sampling_params={"max_new_tokens": 3, "ignore_eos": True},
        return_logprob=[True, False],
    )
    assert "output_token_logprobs" in mixed[0]["meta_info"]
    assert "output_token_logprobs" not in mixed[1]["meta_info"]
    # A batch with parallel sampling.
    out = client.generate(
        input_ids=[PROMPT, [1, 5]],
        sampling_params={"max_new_tokens": 5, "n": 2, "sampling_seed": 7, "ignore_eos": True},
    )
    assert len(out) == 4 and [o["meta_info"]["prompt_tokens"] for o in out] == [6, 6, 2, 2]
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 5} for o in out)
    if kind == "sglang":
        return  # SGLang honours sampling_seed only with --enable-deterministic-inference
    again = client.generate(
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 5, "n": 2, "sampling_seed": 7, "ignore_eos": True},
    )
    assert [a["output_ids"] for a in again] == [o["output_ids"] for o in out[:2]]  # seeded
    assert out[0]["output_ids"] != out[1]["output_ids"]  # sample j draws with seed + j


def test_generate_text_stop_and_zero_tokens(client):
    r = client.generate(text="ab", sampling_params={"max_new_tokens": 40, "ignore_eos": True})
    assert r["meta_info"]["prompt_tokens"] >= 2 and isinstance(r["text"], str)
    # Greedy, so the second call reaches the same text: SGLang's sampling_seed does not
    # make two sampled requests equal with every sampling backend.
    greedy = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0.0}
    full = client.generate(text="ab", sampling_params=greedy)
    stop = full["text"][3:5]
    assert len(stop) == 2, "the completion is long enough to hold a stop string"
    cut = client.generate(text="ab", sampling_params={**greedy, "stop": [stop]})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in cut["text"] and full["text"].startswith(cut["text"])
    zero = client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 0})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["type"] == "length"


def test_info_and_health(client, tiny_dir):
    assert client.health() and client.health_generate()
    info = client.model_info()
    for key in ("model_path", "tokenizer_path", "is_generation", "weight_version"):
        assert key in info
    assert info["model_path"] == str(tiny_dir) and client.get_weight_version() == "0"
    server = client.server_info()
    assert server["weight_version"] == "0" and "version" in server
    assert httpx.get(f"{client.base_url}/health").status_code == 200


def test_update_weights_and_version(client, tiny_dir, tiny_v1, broken_dir, kind):
    before = client.generate(
        input_ids=PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0}
    )
    res = client.update_weights_from_disk(str(tiny_v1), weight_version="1", flush_cache=True)
    assert (
        res["success"]
        and res["num_paused_requests"] == 0
        and set(res)
        == {
            "success",
            "message",
            "num_paused_requests",
        }
    )
    after = client.generate(
        input_ids=PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0}
    )
    assert after["meta_info"]["weight_version"] == "1" and client.get_weight_version() == "1"
    assert after["output_ids"] != before["output_ids"]
    if kind == "embedded":
        # A broken dir is refused (400) and the old weights keep serving. SGLang 0.5.17
        # loads what the folder holds and answers success: its engine actor checks the
        # folder first (engines.sglang.folder_check, test_http_launcher.py).
        with pytest.raises(EngineHTTPError) as e:
            client.update_weights_from_disk(str(broken_dir), weight_version="2")
        assert e.value.status == 400 and "missing" in e.value.message
        assert client.get_weight_version() == "1"
    assert client.update_weight_version("5", abort_all_requests=False)["new_version"] == "5"
    assert client.model_info()["weight_version"] == "5"
    assert client.update_weights_from_disk(str(tiny_dir), weight_version="0")["success"]


def test_weight_update_session_brackets_an_update(client, tiny_dir):
    """``/begin_weight_update`` .. ``/end_weight_update`` (SGLang 0.5.23; 0.5.17 has none,
    and the push then goes without: ``tasks.serving.engine._begin_update_session``)."""
    try:
        client.begin_weight_update()
    except EngineHTTPError as e:
        assert e.status == 404
        pytest.skip("this server has no weight-update sessions (SGLang before 0.5.23)")
    with pytest.raises(EngineHTTPError):  # a second begin without an end is refused
        client.begin_weight_update()
    assert client.update_weights_from_disk(str(tiny_dir), weight_version="0")["success"]
    client.end_weight_update()
    with pytest.raises(EngineHTTPError):  # an end without a begin is refused
        client.end_weight_update()


def test_pause_abort_returns_inflight_and_holds_new(client, pool, kind):
    futs = [_long(pool, client, seed=s) for s in (1, 2)]
    _wait_running(client)
    assert client.flush_cache() is False  # 400 while requests run
    client.pause_generation("abort")
    for f in futs:
        for r in f.result(timeout=30):
            assert r["meta_info"]["finish_reason"]["type"] == "abort"
            assert r["meta_info"]["completion_tokens"] < LONG["max_new_tokens"]
    waiting = pool.submit(client.generate, input_ids=[1, 5], sampling_params={"max_new_tokens": 2})
    time.sleep(0.3)
    assert not waiting.done()  # new requests wait while paused
    assert client.flush_cache() is True
    if kind == "embedded":  # SGLang's /health_generate waits out a pause: 503 after 20 s
        assert client.health_generate()  # health answers while paused
    client.continue_generation()
    assert waiting.result(timeout=30)["meta_info"]["finish_reason"]["type"] in ("stop", "length")


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_update_while_paused_in_place_continues_on_new_weights(
    client, pool, tiny_dir, tiny_v1, mode, kind
):
    fut = _long(pool, client, seed=3)
    _wait_running(client)
    client.pause_generation(mode)
    res = client.update_weights_from_disk(str(tiny_v1), weight_version="1", flush_cache=False)
    assert res["success"]
    if kind == "embedded":  # SGLang 0.5.17 answers 0 here always (its weight_updater)
        assert res["num_paused_requests"] == ROWS
    time.sleep(0.2)
    assert not fut.done()  # parked, not aborted
    client.continue_generation(torch_empty_cache=False)  # as a reload continues
    for r in fut.result(timeout=60):
        meta = r["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        # The version that finished the request: SGLang's meta_info has only that one
        # (its weight_version is read when the reply is built); the embedded engine
        # also says which version began it.
        assert meta.get("weight_version_end", meta["weight_version"]) == "1"
        if kind == "embedded":
            assert meta["weight_version"] == "0"  # mixed, and says so
    assert client.update_weights_from_disk(str(tiny_dir), weight_version="0")["success"]


def test_update_with_abort_all_requests_ends_inflight(client, pool, tiny_dir, tiny_v1):
    fut = _long(pool, client, seed=4)
    _wait_running(client)
    res = client.update_weights_from_disk(str(tiny_v1), weight_version="1", abort_all_requests=True)
    assert res["success"]
    for r in fut.result(timeout=30):
        assert r["meta_info"]["finish_reason"]["type"] == "abort"
        assert r["meta_info"]["weight_version"] == "0"  # never continued on the new weights
    fresh = client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2})
    assert fresh["meta_info"]["weight_version"] == "1"
    assert client.update_weights_from_disk(str(tiny_dir), weight_version="0")["success"]


def test_abort_request_by_rid_and_all(client, pool):
    params = dict(LONG, n=1)
    keep = pool.submit(
        client.generate,
        input_ids=PROMPT,
        sampling_params=dict(params, max_new_tokens=60),
        rid="keep",
    )
    stop = pool.submit(client.generate, input_ids=PROMPT, sampling_params=params, rid="stop-me")
    _wait_running(client)
    client.abort_request("stop-me")
    r = stop.result(timeout=30)
    assert r["meta_info"]["id"] == "stop-me" and r["meta_info"]["finish_reason"]["type"] == "abort"
    assert keep.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "length"
    fut = _long(pool, client, seed=5)
    _wait_running(client)
    client.abort_request(abort_all=True)
    assert {r["meta_info"]["finish_reason"]["type"] for r in fut.result(timeout=30)} == {"abort"}


def test_memory_release_and_resume(client, kind):
    """Sleep and wake by tag, then serve again. Resume names what was released: SGLang
    0.5.17's scheduler dies (KeyError) on resuming a tag it never released, and None means
    every tag there. SGLang answers 200 with an empty body (its engine actor reports the
    state: ``engines.sglang.engine``); the embedded server says what it did, and refuses
    a tag it does not know (SGLang is not asked: its scheduler would die)."""
    released = client.release_memory_occupation(["weights", "kv_cache"])
    resumed = client.resume_memory_occupation(["weights", "kv_cache"])
    params = {"max_new_tokens": 2, "ignore_eos": True}
    out = client.generate(input_ids=PROMPT, sampling_params=params)
    assert out["meta_info"]["completion_tokens"] == 2  # the server serves again
    if kind == "embedded":
        assert released["success"] and resumed["success"]
        with pytest.raises(EngineHTTPError) as e:
            client.release_memory_occupation(["gpu"])
        assert e.value.status == 400
