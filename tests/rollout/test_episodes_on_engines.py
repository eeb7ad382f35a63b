"""Multi-turn episodes on real embedded engines over their SGLang HTTP API
(``tasks.rollouts.services.EngineTurns``): an engine killed mid-episode, and a
prompt longer than the context, refused by the engine."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import ray

from engines.client import EngineClient, EngineHTTPError
from engines.config import EngineConfig
from engines.group import EngineGroup
from rollout.config import RolloutConfig
from rollout.failures import FailureLog
from rollout.procedure import RolloutIO, generate_batch
from tasks.rollouts.services import EngineTurns
from training.tiny_model import build_tokenizer

TOK = build_tokenizer()
SEED = 0  # engine 0's share has episodes that call the tool (checked below)


@pytest.fixture(scope="module")
def group(ray_cluster, tiny_model_dir):
    g = EngineGroup(
        f"agentic-{uuid.uuid4().hex[:6]}", EngineConfig(num_engines=2, num_cpus_per_engine=0.5)
    )
    g.start(tiny_model_dir, 0)
    g.start_http()
    yield g
    g.shutdown()


def turns(group, tiny_model_dir) -> EngineTurns:
    def restart(i: int) -> None:
        group.restart(i, tiny_model_dir, 0)
        group.start_http()

    return EngineTurns(group.client, [0, 1], group.is_alive, restart)


class KillAfterFirstTurn(EngineTurns):
    """Kills engine 0's actor once its first call has answered (the failure is real:
    the next call to it finds no server)."""

    killed = False

    def generate(self, engine, input_ids, sampling):
        out = super().generate(engine, input_ids, sampling)
        if engine == 0 and not self.killed:
            self.killed = True
            ray.kill(self._group_handle(0), no_restart=True)
            # ray.kill returns before the process is gone: until then its HTTP server
            # still answers, and under load engine 0's next turn could be served
            deadline = time.monotonic() + 60
            with EngineClient(self._url0, timeout_s=5, retries=0) as client:
                while time.monotonic() < deadline:
                    try:
                        client.model_info()
                    except (EngineHTTPError, TimeoutError):  # refused or reset: gone
                        break
                    time.sleep(0.05)
        return out


def rollout(cfg: RolloutConfig, engines: EngineTurns, log: FailureLog):
    io = RolloutIO(turns=engines, failures=log)
    return generate_batch(cfg, SEED, 1, 0, TOK, None, lambda i: None, io=io).batch


def test_a_prompt_longer_than_the_context_is_refused_and_dropped(group, tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "1+2=", "label": "3"}, {"prompt": "1" * 70 + "=", "label": "1"}]
    rows += [{"prompt": "2+2=", "label": "4"}, {"prompt": "3+1=", "label": "4"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = RolloutConfig(
        task=str(data),
        environment="calculator",
        batch_size=4,
        n_samples_per_prompt=2,
        failures={"on_exhausted": "drop", "max_batch_fraction": 0.25},
    )
    engines = turns(group, tiny_model_dir)
    log = FailureLog(cfg.failures, 1, 4)
    batch = rollout(cfg, engines, log)
    engines.close()
    (drop,) = batch.failures.drops
    assert (drop.kind, drop.attempts, drop.replacement) == ("data", 1, None)
    assert "exceeds the context length" in drop.error
    kept = {s.prompt_index for s in batch.samples}
    assert len(kept) == 3 and drop.prompt_index not in kept and len(batch.samples) == 6


# Last in the module: it leaves engine 0 dead (the fixture's shutdown ends the group).
def test_an_engine_killed_mid_episode_is_replaced_by_another_and_the_batch_is_unchanged(
    group, tiny_model_dir
):
    cfg = RolloutConfig(
        task="add", environment="calculator", batch_size=8, n_samples_per_prompt=4, max_new_tokens=5
    )
    clean_turns = turns(group, tiny_model_dir)
    clean = rollout(cfg, clean_turns, FailureLog(cfg.failures, 1, 8))
    clean_turns.close()
    killer = KillAfterFirstTurn(group.client, [0, 1], group.is_alive, lambda i: None)
    killer._group_handle, killer._url0 = group.handle, group.urls()[0]
    log = FailureLog(cfg.failures, 1, 8)
    batch = rollout(cfg, killer, log)
    killer.close()
    assert killer.killed and group.handle(0) is None
    # engine 0's share went on at turn 1 on engine 1: same rows, seeds, weights, numbers
    assert [(r.engine, r.turn, r.kind) for r in log.retries][:1] == [(0, 1, "infra")]
    assert batch.failures.drops == []
    assert json.dumps(batch.to_json()["samples"]) == json.dumps(clean.to_json()["samples"])
    multi = [s for s in batch.samples if len(s.turns) > 1]
    assert multi, "some episode of this seed calls the tool"
