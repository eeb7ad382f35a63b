"""One bad request cannot fail, hang or kill an engine.

Requests are checked against the model (vocabulary, context length, seed
range) and refused alone; a request that fails inside a batch fails alone;
requests have a deadline; a dead decode loop is reported unhealthy and the
engine group restarts the engine. Real HTTP on loopback, real Ray actors.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import ray

from engines.config import EngineConfig
from engines.embedded.batching import EngineDeadError
from engines.embedded.engine import EmbeddedEngine
from engines.embedded.http_server import ServerSettings, serve_in_thread
from engines.group import EngineGroup

PROMPT = [1, 5, 6, 7, 25, 8]
GOOD = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "sampling_seed": 1}}
STANDIN = str(Path(__file__).with_name("standin_sglang_server.py"))


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return EmbeddedEngine(str(tiny_dir), 0, EngineConfig(), weight_version=0)


@pytest.fixture(scope="module")
def url(engine):
    thread = serve_in_thread(engine, ServerSettings())
    yield thread.url
    thread.stop()


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=60)


def test_good_requests_beside_a_bad_one_all_succeed(url, engine):
    vocab = engine.limits.vocab_size
    bad = [
        {"input_ids": [1, vocab], "sampling_params": {"max_new_tokens": 8}},
        {"input_ids": [1, -3], "sampling_params": {"max_new_tokens": 8}},
    ]
    with ThreadPoolExecutor(16) as pool:
        goods = [pool.submit(_post, url, GOOD) for _ in range(40)]
        bads = [pool.submit(_post, url, b) for b in bad]
        replies = [f.result() for f in goods]
        refused = [f.result() for f in bads]
    assert [r.status_code for r in replies] == [200] * 40
    assert len({tuple(r.json()["output_ids"]) for r in replies}) == 1  # same seed, same tokens
    for r in refused:
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["message"]


HANGS = {
    "max_new_tokens 1e9": (
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10**9}},
        "context length 64",
    ),
    "seed 2**64": (
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "sampling_seed": 2**64}},
        "sampling_seed",
    ),
    "seed 2**63-1 with n=2": (
        {"input_ids": PROMPT, "sampling_params": {"n": 2, "sampling_seed": 2**63 - 1}},
        "sampling_seed",
    ),
    "1 MB prompt": ({"input_ids": [5] * (1 << 20)}, "context length 64"),
    "1 MB text": ({"text": "a" * (1 << 20)}, "context length 64"),
}


@pytest.mark.parametrize("case", sorted(HANGS))
def test_requests_beyond_the_model_are_refused_and_the_engine_answers(url, case):
    body, bound = HANGS[case]
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == 400 and bound in r.json()["message"], r.text
    # The next request is answered (a hung engine would time this out).
    assert _post(url, GOOD).status_code == 200
    assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200


def test_over_ray_a_bad_row_is_a_value_error_for_its_call_only(engine):
    good = {"max_new_tokens": 4, "sampling_seed": 3}
    with ThreadPoolExecutor(2) as pool:
        ok = pool.submit(engine.generate, [PROMPT] * 3, good)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.generate([PROMPT, [1, 10**6]], good)
        with pytest.raises(ValueError, match="sampling_seed"):
            engine.generate([PROMPT], dict(good, sampling_seed=-1))
        with pytest.raises(ValueError, match="context length"):
            engine.generate([PROMPT], dict(good, max_new_tokens=64))
        assert len(ok.result(timeout=60)) == 3
    assert engine.health_generate() and engine.decode_alive()


POISON = 20  # a valid token id that the faulty forward below refuses


def test_a_request_whose_forward_fails_fails_alone(tiny_dir):
    eng = EmbeddedEngine(str(tiny_dir), 0, EngineConfig(), weight_version=0)
    params = {"max_new_tokens": 6, "sampling_seed": 5, "stop_token_ids": []}
    prompts = [[1, 5 + k, 6] for k in range(6)]
    alone = [eng.generate([p], params)[0]["output_ids"] for p in prompts]
    real_forward = eng.served.model.forward

    def faulty_forward(*args, **kwargs):  # FAULT INJECTION: fails any batch with POISON
        if (kwargs["input_ids"] == POISON).any():
            raise RuntimeError("injected fault: poisoned row")
        return real_forward(*args, **kwargs)

    eng.served.model.forward = faulty_forward
    eng.pause_generation("abort")  # hold every call back, then release them all at once
    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(eng.generate, [p], params) for p in prompts]
        bad = pool.submit(eng.generate, [[1, POISON, 6]], params)
        time.sleep(0.3)  # every call is waiting for continue_generation
        eng.continue_generation()
        with pytest.raises(RuntimeError, match="injected fault"):
            bad.result(timeout=60)
        assert [f.result(timeout=60)[0]["output_ids"] for f in goods] == alone
    assert eng.decode_alive()


def test_requests_past_their_deadline_end_with_abort(tiny_dir):
    cfg = EngineConfig(request_timeout_s=0.5, context_length=4096)
    eng = EmbeddedEngine(str(tiny_dir), 0, cfg, weight_version=0)
    long = {"max_new_tokens": 4000, "stop_token_ids": [], "sampling_seed": 1}
    # Queued behind a pause that outlasts the deadline: answered, not held forever.
    eng.pause_generation("abort")
    (r,) = eng.generate([PROMPT], long)
    assert r["meta_info"]["finish_reason"]["type"] == "abort"
    assert "request_timeout_s" in r["meta_info"]["finish_reason"]["message"]
    eng.continue_generation()
    # Running, parked in place past the deadline: ends at the next step.
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(r=eng.generate([PROMPT], long)[0]))
    t.start()
    while eng.get_load()["num_running_reqs"] == 0:
        time.sleep(0.01)
    eng.pause_generation("in_place")
    time.sleep(1.0)
    eng.continue_generation()
    t.join(timeout=60)
    meta = box["r"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 4000
    assert "request_timeout_s" in meta["finish_reason"]["message"]


def test_dead_decode_loop_is_unhealthy_and_the_group_restarts_it(ray_cluster, tiny_dir, run_name):
    cfg = EngineConfig(num_engines=1, num_cpus_per_engine=1.0, health_timeout_s=60.0)
    group = EngineGroup(run_name, cfg, namespace="prefect-rl-test")
    group.start(str(tiny_dir), 0)
    try:
        victim = group.handle(0)
        url = group.start_http()[0]

        def kill_decode_loop(engine):  # FAULT INJECTION: something escapes every handler
            class InjectedFault(BaseException):
                pass

            def runner():
                raise InjectedFault("injected: the decode thread dies")

            engine.served.runner = runner

        ray.get(victim.__ray_call__.remote(kill_decode_loop))
        with pytest.raises(EngineDeadError, match="decode loop died"):
            ray.get(victim.generate.remote([PROMPT], {"max_new_tokens": 2}), timeout=60)
        assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 503
        assert group.is_alive(0) is False
        with pytest.raises(EngineDeadError):  # new work is refused at once, never queued
            ray.get(victim.generate.remote([PROMPT], {"max_new_tokens": 2}), timeout=60)
        # A rollout on the group restarts the engine and completes.
        out = group.generate_groups([PROMPT], 2, {"max_new_tokens": 4}, [[1, 2]])
        assert len(out[0]) == 2
        assert group.handle(0)._actor_id != victim._actor_id and group.is_alive(0)
    finally:
        group.shutdown()


def test_sigterm_stops_a_served_engine_after_bad_requests(tiny_dir):
    with httpx.Client() as probe:
        port = _free_port()
        proc = subprocess.Popen(
            [sys.executable, STANDIN, "--model-path", str(tiny_dir), "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while True:
                try:
                    if probe.get(f"{url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    assert time.monotonic() < deadline and proc.poll() is None
                    time.sleep(0.2)
            body, _ = HANGS["seed 2**64"]
            assert probe.post(f"{url}/generate", json=body, timeout=30).status_code == 400
            assert probe.get(f"{url}/health_generate", timeout=30).status_code == 200
            os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=60) is not None  # a hung server would hit the timeout
        finally:
            if proc.poll() is None:
                proc.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
