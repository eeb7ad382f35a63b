"""Pause, continue, flush and in-flight weight updates on a real engine actor.

The actor comes from the engine group, threaded as in production, so control
calls are served while a long generation runs.
"""

from __future__ import annotations

import time

import pytest
import ray

LONG = {"temperature": 1.0, "max_new_tokens": 400, "stop_token_ids": []}
PROMPT = [1, 5, 6, 7, 25, 8]
ROWS = 4
ENGINES = 1  # the module's engine group (conftest): these tests drive one engine


@pytest.fixture(scope="module")
def actor(engine_group):
    # The engine of the module's group: created by the group as a threaded actor
    # with a control concurrency group, exactly as in production.
    return engine_group.handle(0)


def _long(actor, seed0: int = 0):
    return actor.generate.remote(
        [PROMPT] * ROWS, [dict(LONG, sampling_seed=seed0 + j) for j in range(ROWS)]
    )


def _wait_running(actor, rows: int = 1) -> None:
    """Until rows are decoding (a pause must find rows in flight) and ``rows`` rows
    have reached the engine: a call still on its way when the pause lands would wait
    for a continue that the test never sends (on a loaded machine, Ray may deliver
    the last of several calls seconds after the first)."""
    deadline = time.monotonic() + 60
    while True:
        load = ray.get(actor.get_load.remote())
        if load["num_running_reqs"] and sum(load.values()) >= rows:
            return
        assert time.monotonic() < deadline, f"generation never started: {load}"
        time.sleep(0.01)


def _not_done(ref, wait_s: float = 0.3) -> bool:
    ready, _ = ray.wait([ref], timeout=wait_s)
    return not ready


def test_pause_in_place_keeps_state(actor):
    ref = _long(actor)
    _wait_running(actor)
    assert ray.get(actor.flush_cache.remote()) is False  # refused while decoding
    ray.get(actor.pause_generation.remote("in_place"))
    assert ray.get(actor.flush_cache.remote()) is False  # paused requests still hold state
    assert _not_done(ref)
    waiting = actor.generate.remote([[1, 5]], [{"max_new_tokens": 3, "sampling_seed": 1}])
    assert _not_done(waiting)  # new calls wait while paused
    ray.get(actor.continue_generation.remote())
    out = ray.get(ref)
    for r in out:
        assert r["meta_info"]["finish_reason"]["type"] == "length"
        assert r["meta_info"]["completion_tokens"] == LONG["max_new_tokens"]
    assert len(ray.get(waiting)[0]["output_ids"]) >= 1
    # The pause left no trace: the same request unpaused gives the same tokens.
    again = ray.get(_long(actor))
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in out]


def test_pause_abort_ends_requests(actor):
    # Eight calls occupy every generate thread: control calls must still be served.
    refs = [_long(actor, seed0=10 + 10 * k) for k in range(8)]
    _wait_running(actor, rows=8 * ROWS)
    # Generous: on a loaded 2-core machine a pause behind eight busy calls took over 10 s.
    ray.get(actor.pause_generation.remote("abort"), timeout=60)
    out = [r for call in ray.get(refs, timeout=60) for r in call]  # no continue needed
    assert len(out) == 8 * ROWS
    for r in out:
        meta = r["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert meta["completion_tokens"] < LONG["max_new_tokens"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert ray.get(actor.flush_cache.remote()) is True
    waiting = actor.generate.remote([[1, 5]], [{"max_new_tokens": 3}])
    assert _not_done(waiting)
    assert ray.get(actor.health_generate.remote()) is True  # health answers while paused
    ray.get(actor.continue_generation.remote())
    assert ray.get(waiting)[0]["meta_info"]["finish_reason"]["type"] in ("stop", "length")


def test_update_while_paused_in_place_is_recorded(actor, tiny_v1):
    start = ray.get(actor.get_weight_version.remote())
    new = str(int(start) + 1)
    ref = _long(actor, seed0=20)
    _wait_running(actor)
    ray.get(actor.pause_generation.remote("in_place"))
    res = ray.get(actor.update_weights_from_disk.remote(str(tiny_v1), weight_version=new))
    assert res["success"] and res["num_paused_requests"] == ROWS
    ray.get(actor.continue_generation.remote())
    for r in ray.get(ref):
        # Started on v0, finished on v1 (SGLang in-place semantics), and says so.
        assert r["meta_info"]["weight_version"] == start
        assert r["meta_info"]["weight_version_end"] == new
    assert ray.get(actor.model_info.remote())["weight_version"] == new


def test_pause_retract_requeues_and_resumes_the_same_tokens(actor, tiny_dir):
    assert ray.get(actor.update_weights_from_disk.remote(str(tiny_dir), weight_version="0"))[
        "success"
    ]
    ref = _long(actor, seed0=40)
    _wait_running(actor)
    ray.get(actor.pause_generation.remote("retract"))
    # KV cache dropped: nothing runs, the requests wait at the head of the queue.
    assert ray.get(actor.get_load.remote()) == {"num_running_reqs": 0, "num_waiting_reqs": ROWS}
    assert _not_done(ref)
    ray.get(actor.continue_generation.remote())
    out = ray.get(ref)
    for r in out:
        assert r["meta_info"]["finish_reason"]["type"] == "length"
        assert r["meta_info"]["completion_tokens"] == LONG["max_new_tokens"]
        assert len(r["meta_info"]["output_token_logprobs"]) == LONG["max_new_tokens"]
    # Re-prefilled with what they had, same generators: as if never paused.
    again = ray.get(_long(actor, seed0=40))
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in out]


def test_update_while_retracted_continues_on_the_new_weights(actor, tiny_dir, tiny_v1):
    assert ray.get(actor.update_weights_from_disk.remote(str(tiny_dir), weight_version="0"))[
        "success"
    ]
    ref = _long(actor, seed0=50)
    _wait_running(actor)
    ray.get(actor.pause_generation.remote("retract"))
    res = ray.get(actor.update_weights_from_disk.remote(str(tiny_v1), weight_version="1"))
    assert res["success"] and res["num_paused_requests"] == ROWS  # retracted, not aborted
    ray.get(actor.continue_generation.remote())
    for r in ray.get(ref):
        assert r["meta_info"]["weight_version"] == "0"
        assert r["meta_info"]["weight_version_end"] == "1"
        assert r["meta_info"]["completion_tokens"] == LONG["max_new_tokens"]
    assert ray.get(actor.update_weights_from_disk.remote(str(tiny_dir), weight_version="0"))[
        "success"
    ]
