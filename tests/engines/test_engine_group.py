"""EngineGroup on a real Ray cluster: placement, dispatch, restart after a kill,
HTTP served from inside the engine actors.

The session's two-engine group (conftest) serves the module; tests run in
file order and each leaves both engines alive. Shutdown is checked in the
fixture's teardown.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import ray

from engines.group import EngineGroup

SAMPLING = {"temperature": 1.0, "max_new_tokens": 24}
PROMPTS = [[1] + list(range(5, 5 + k)) for k in range(1, 9)]  # distinct lengths 2..9
N = 2
SEEDS = [[1000 + 10 * g + j for j in range(N)] for g in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def group(engine_group, tiny_dir):
    # Back on v0 whatever ran before (versions are labels to the engine).
    for i in range(2):
        res = ray.get(engine_group.handle(i).update_weights_from_disk.remote(str(tiny_dir), "0"))
        assert res["success"]
    return engine_group


def _check_batch(results, version: str) -> None:
    assert len(results) == len(PROMPTS)
    for prompt, grp in zip(PROMPTS, results):
        assert len(grp) == N
        assert {r["meta_info"]["prompt_tokens"] for r in grp} == {len(prompt)}
        assert len({r["meta_info"]["engine_id"] for r in grp}) == 1  # a group never splits
        for r in grp:
            assert r["meta_info"]["weight_version"] == version
            assert r["meta_info"]["finish_reason"]["type"] in ("stop", "length")


def test_start_is_idempotent_and_placed(group, tiny_dir, pg_names):
    first = {i: group.handle(i)._actor_id for i in range(2)}
    group.start(str(tiny_dir), weight_version=0)
    assert {i: group.handle(i)._actor_id for i in range(2)} == first
    assert {group.pg_name(0), group.pg_name(1)} <= pg_names()
    assert group.is_alive(0) and group.is_alive(1)
    assert not EngineGroup("nobody", group.cfg, group.namespace).is_alive(0)


def test_dispatch_across_engines(group):
    results = group.generate_groups(PROMPTS, N, SAMPLING, SEEDS)
    _check_batch(results, "0")
    used = {grp[0]["meta_info"]["engine_id"] for grp in results}
    assert used == {0, 1}
    again = group.generate_groups(PROMPTS, N, SAMPLING, SEEDS)
    assert _bits(again) == _bits(results)  # tokens and logprobs, to the last bit


def _bits(results) -> list:
    """What a trainer reads of each sample: its tokens and the engine's logprobs."""
    return [
        [(r["output_ids"], r["meta_info"]["output_token_logprobs"]) for r in g] for g in results
    ]


def test_reload_both_then_same_tokens_anywhere(group, tiny_v1):
    for i in range(2):
        res = ray.get(group.handle(i).update_weights_from_disk.remote(str(tiny_v1), "1"))
        assert res["success"]
    # Same version on both engines: a request's tokens do not depend on where it ran.
    p = [[1, 5, 6]], [dict(SAMPLING, sampling_seed=3)]
    a, b = (ray.get(group.handle(i).generate.remote(*p))[0] for i in range(2))
    assert a["output_ids"] == b["output_ids"]


def test_engine_killed_mid_rollout_is_restarted(group, tiny_v1, caplog):
    slow = dict(SAMPLING, max_new_tokens=200, stop_token_ids=[])
    reference = group.generate_groups(PROMPTS, N, slow, SEEDS)
    victim = group.handle(0)
    box: dict = {}
    t = threading.Thread(
        target=lambda: box.update(out=group.generate_groups(PROMPTS, N, slow, SEEDS))
    )
    t.start()
    deadline = time.monotonic() + 20
    while ray.get(victim.get_load.remote())["num_running_reqs"] == 0:  # wait until decoding
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ray.kill(victim, no_restart=True)
    t.join(timeout=120)
    assert not t.is_alive()
    # Complete, in order, every group whole, and all on v1: the restarted
    # engine loaded the version its live peer serves.
    _check_batch(box["out"], "1")
    assert _bits(box["out"]) == _bits(reference)
    # The restart reloaded the version it was given (by default: the peer's).
    assert group.handle(0)._actor_id != victim._actor_id
    info = ray.get(group.handle(0).model_info.remote())
    assert info["weight_version"] == "1" and info["model_path"] == str(tiny_v1)
    # An engine that ran and died: a real restart, so a WARNING (a first start is INFO).
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"restarting {group.actor_name(0)} at version 1" in warned


def test_each_engine_serves_http_from_its_actor(group, tiny_v1):
    urls = group.start_http(allowed_roots=[str(tiny_v1)])
    assert set(urls) == {0, 1} and group.urls() == urls
    assert group.start_http() == urls  # idempotent
    for i in urls:
        with group.client(i) as client:
            r = client.generate(input_ids=[1, 5], sampling_params={"max_new_tokens": 2})
            assert r["meta_info"]["engine_id"] == i
            version = client.get_weight_version()
            # Ray and HTTP see one engine.
            assert ray.get(group.handle(i).get_weight_version.remote()) == version
