"""Multi-turn episodes and each prompt's failure budget (``rollout.agent``,
``rollout.failures``) against ``ScriptedEngines``: a fake engine with a
scripted policy, since no real model calls a tool on cue. Real engines, HTTP
and a killed engine are in test_episodes_on_engines.py."""

from __future__ import annotations

import threading

import pytest

from rollout.config import RolloutConfig
from rollout.failures import (
    EngineUnavailable,
    FailureLog,
    RequestRefused,
    RolloutFailed,
    RolloutStalled,
    spare_index,
)
from rollout.procedure import RolloutIO, generate_batch
from rollout.types import RolloutBatch
from training.batch import build_train_batch
from training.tiny_model import build_tokenizer

TOK = build_tokenizer()


class ScriptedEngines:
    """FAKE engines (``TurnEngines``): turn 0 calls the calculator with the prompt's
    sum, turn 1 answers the observation's value. ``fail`` maps (engine, turn) to
    how many calls there raise EngineUnavailable; a context starting with a prompt
    of ``refuse`` is refused like an engine's context-length check."""

    def __init__(self, engines: int = 2, version: int = 3) -> None:
        self.ids, self.version = list(range(engines)), version
        self.refuse: set[str] = set()  # prompt texts refused like an over-long prompt
        self.fail: dict[tuple[int, int], int] = {}
        self.calls: list[tuple[int, int, int]] = []  # (engine, turn, rows)
        self.hang: threading.Event | None = None

    def engine_ids(self) -> list[int]:
        return self.ids

    def failover(self, engine: int) -> int:
        return self.ids[(self.ids.index(engine) + 1) % len(self.ids)]

    def generate(self, engine, input_ids, sampling):
        turn = max(TOK.decode(ids).count("?") for ids in input_ids)  # calls made so far
        self.calls.append((engine, turn, len(input_ids)))
        if self.hang is not None:
            self.hang.wait(10)
        if self.fail.get((engine, turn), 0) > 0:
            self.fail[(engine, turn)] -= 1
            raise EngineUnavailable(f"engine {engine}: connection refused")
        texts = [TOK.decode(ids, skip_special_tokens=True) for ids in input_ids]
        if any(t.startswith(p) for t in texts for p in self.refuse):
            raise RequestRefused("prompt exceeds the context length")
        return [self._turn(t) for t in texts]

    def _turn(self, context: str) -> dict:
        if "?" not in context:
            text = "?" + context.split("=")[0]
        else:
            text = context.rsplit(":", 1)[1].rstrip(".")
        ids = TOK(text, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
        meta = {
            "weight_version": str(self.version),
            "finish_reason": {"type": "stop"},
            "output_token_logprobs": [[-0.25, t, None] for t in ids],
        }
        return {"output_ids": ids, "meta_info": meta}


def cfg(**kw) -> RolloutConfig:
    base = dict(task="add", environment="calculator", reward="exact", batch_size=4)
    return RolloutConfig(**{**base, "n_samples_per_prompt": 2, **kw})


def rollout(
    c: RolloutConfig, engines: ScriptedEngines, log: FailureLog | None = None
) -> RolloutBatch:
    io = RolloutIO(turns=engines, failures=log)
    return generate_batch(c, 0, 1, 3, TOK, None, lambda i: None, io=io).batch


def test_tool_tokens_are_masked_out_of_the_loss():
    batch = rollout(cfg(), ScriptedEngines())
    s = batch.samples[0]
    assert [t.role for t in s.turns] == ["model", "tool", "model"]
    call, obs, answer = s.turns
    assert call.text.startswith("?") and obs.text.startswith(":") and s.reward == 1.0
    assert s.loss_mask == [1] * len(call.ids) + [0] * len(obs.ids) + [1] * len(answer.ids)
    assert {t.weight_version for t in s.turns} == {3, None}
    train = build_train_batch(batch, pad_id=TOK.pad_token_id)
    p = len(s.prompt_ids)
    row = train.loss_mask[0, p - 1 : p - 1 + len(s.response_ids)].tolist()
    assert row == [float(m) for m in s.loss_mask]
    obs_at = slice(p - 1 + len(call.ids), p - 1 + len(call.ids) + len(obs.ids))
    assert train.rollout_logprobs[0, obs_at].abs().sum() == 0
    assert all(r == 1.0 for r in batch.rewards)  # the scripted policy answers right


def test_a_failed_call_is_retried_on_another_engine_and_changes_nothing():
    clean = rollout(cfg(), ScriptedEngines())
    engines = ScriptedEngines()
    engines.fail[(0, 1)] = 1  # engine 0 fails its share's second turn once
    log = FailureLog(cfg().failures, 1, 4)
    batch = rollout(cfg(), engines, log)
    assert batch.samples == clean.samples
    assert (0, 1, 4) in engines.calls and (1, 1, 4) in engines.calls  # the same 4 rows, moved
    assert [(r.engine, r.turn, r.kind) for r in batch.failures.retries] == [(0, 1, "infra")] * 2
    assert batch.failures.drops == []


def test_a_prompt_past_its_budget_is_replaced_and_a_retry_replays_the_drop():
    persisted: list[dict] = []
    c = cfg(failures={"infra_retries": 1, "max_batch_fraction": 0.5})
    engines = ScriptedEngines(engines=1)
    engines.fail[(0, 0)] = 2  # the only engine fails twice: every prompt of its call is out
    log = FailureLog(c.failures, 1, 4, persist=persisted.append)
    with pytest.raises(RolloutFailed, match="3 prompts failed, more than .*max_batch_fraction=0.5"):
        rollout(c, engines, log)
    assert [d.replacement for d in log.drops] == [spare_index(1, 0), spare_index(1, 1)]

    # the step's retry: the engine is healthy, the record of the first attempt replays
    c = cfg(failures={"infra_retries": 1, "max_batch_fraction": 1.0})
    replay = FailureLog(c.failures, 1, 4, persisted=persisted[-1])
    batch = rollout(c, ScriptedEngines(engines=1), replay)
    indices = [s.prompt_index for s in batch.samples[::2]]
    assert indices[:2] == [spare_index(1, 0), spare_index(1, 1)]  # in the failed prompts' places
    assert indices[2:] == [2, 3]
    assert len(batch.samples) == 8 and all(r == 1.0 for r in batch.rewards)


def test_a_refused_prompt_is_dropped_alone_and_its_neighbours_kept():
    c = cfg(failures={"data_retries": 1, "on_exhausted": "drop", "max_batch_fraction": 0.25})
    engines = ScriptedEngines(engines=1)
    clean = rollout(c, ScriptedEngines(engines=1))
    refused = clean.samples[2].prompt_index  # the second prompt of the batch
    engines.refuse = {f"{p}" for p in [_text(c, refused)]}
    batch = rollout(c, engines)
    assert [s.prompt_index for s in batch.samples[::2]] == [
        s.prompt_index for s in clean.samples[::2] if s.prompt_index != refused
    ]
    (drop,) = batch.failures.drops
    assert (drop.prompt_index, drop.kind, drop.attempts, drop.replacement) == (
        refused,
        "data",
        2,
        None,
    )
    # its neighbours' turns, sent alone after the refused call, are the same
    assert batch.samples[:2] == clean.samples[:2] and batch.samples[2:] == clean.samples[4:]


def _text(c: RolloutConfig, index: int) -> str:
    from rollout.datasets import PromptSource

    return PromptSource(c, 0).prompts([index])[0].text


def test_a_hung_engine_fails_the_rollout_by_the_stall_watchdog():
    engines = ScriptedEngines()
    engines.hang = threading.Event()
    try:
        with pytest.raises(
            RolloutStalled, match=r"no turn finished for rollout.failures.stall_s=0.2s"
        ):
            rollout(cfg(failures={"stall_s": 0.2}), engines)
    finally:
        engines.hang.set()
