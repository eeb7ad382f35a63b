"""A step stuck on a paused engine fails at its deadline, with a message naming
the engine and the call, over Ray and over HTTP; the engine is unharmed and
serves again once continued."""

from __future__ import annotations

import uuid

import pytest
import ray

from actors.deadline import CallTimeout
from engines.config import EngineConfig
from engines.group import EngineGroup

SAMPLING = {"temperature": 1.0, "max_new_tokens": 3}


@pytest.fixture(scope="module")
def paused(ray_cluster, tiny_model_dir):
    """One real engine, paused in place: generation waits until it is continued."""
    cfg = EngineConfig(num_engines=1, num_cpus_per_engine=0.5, health_timeout_s=60.0)
    group = EngineGroup(
        f"deadline-{uuid.uuid4().hex[:8]}", cfg, namespace="prefect-rl-test", call_timeout_s=120
    )
    group.start(tiny_model_dir)
    group.start_http()
    group.call_timeout_s = 2.0  # the step's deadline from here on
    ray.get(group.handle(0).pause_generation.remote("in_place"))
    yield group
    group.shutdown()


def test_a_rollout_on_a_paused_engine_fails_at_the_deadline(paused):
    with pytest.raises(CallTimeout) as e:
        paused.generate_groups([[1, 5, 6]], 2, SAMPLING, [[1, 2]])
    message = str(e.value)
    assert paused.actor_name(0) in message and "generate" in message
    assert "tasks.timeout_s" in message  # the knob that sets it
    assert isinstance(e.value, TimeoutError)  # what Prefect's retry sees


def test_an_http_request_to_a_paused_engine_fails_at_the_deadline(paused):
    with paused.client(0) as client:
        assert client.deadline_s == 2.0  # the group's deadline reaches every request
        with pytest.raises(TimeoutError) as e:
            client.generate(input_ids=[1, 5, 6], sampling_params=SAMPLING)
        assert client.base_url in str(e.value) and "/generate" in str(e.value)
        client.continue_generation()
        # The engine was only waiting: continued, the same call answers.
        out = client.generate(input_ids=[1, 5, 6], sampling_params=SAMPLING)
    assert len(out["output_ids"]) >= 1
    ray.get(paused.handle(0).pause_generation.remote("in_place"))


def test_a_call_on_a_stuck_train_rank_names_the_rank(ray_cluster):
    from actors.deadline import get

    @ray.remote(num_cpus=0)
    class Rank:
        def step(self, seconds: float) -> int:
            import time

            time.sleep(seconds)
            return 1

    fast, slow = Rank.remote(), Rank.remote()
    refs = [fast.step.remote(0), slow.step.remote(600)]
    with pytest.raises(CallTimeout, match=r"run/train/1: train_step\(3\) did not return"):
        get(refs, 2.0, "train_step(3)", ["run/train/0", "run/train/1"])
    assert get([fast.step.remote(0)], 30.0, "train_step(3)", ["run/train/0"]) == [1]
    ray.kill(slow)
