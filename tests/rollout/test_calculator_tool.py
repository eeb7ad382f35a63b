"""The calculator tool's grammar and environment: calls get values, malformed
calls get an error observation (never an exception), an answer ends the episode."""

from __future__ import annotations

import pytest

from rollout.config import RolloutConfig
from rollout.environments import make_environment
from rollout.tools import BAD_CALL, evaluate, parse_call
from rollout.types import Prompt


@pytest.mark.parametrize(
    ("text", "expr", "value"),
    [("?3+4", "3+4", 7), (" ?12-5+1 ", "12-5+1", 8), ("?7", "7", 7), ("? 0-9", "0-9", -9)],
)
def test_calls_parse_and_evaluate(text, expr, value):
    assert parse_call(text) == expr
    assert evaluate(expr) == value


@pytest.mark.parametrize("text", ["?", "?3+", "?+3", "?3++4", "?3*4", "?a", "?1234567", "?3+4 5"])
def test_malformed_calls_are_refused_by_the_grammar(text):
    with pytest.raises(ValueError, match="not a calculator expression"):
        parse_call(text)


def test_an_episode_calls_then_answers_and_bad_calls_are_observations():
    env = make_environment("calculator")
    env.reset(Prompt(index=0, text="3+4=", label="7"))
    bad = env.step("?3+")
    assert (bad.observation, bad.done) == (BAD_CALL, False)
    call = env.step("?3+4")
    assert (call.observation, call.reward, call.done) == (":7.", 0.0, False)
    assert env.answer == ""
    end = env.step(" 7")
    assert (end.observation, end.done) == ("", True)
    assert env.answer == "7"


def test_unknown_environment_is_refused_at_load():
    with pytest.raises(ValueError, match="rollout.environment 'shell' is not a builtin"):
        RolloutConfig(environment="shell")
