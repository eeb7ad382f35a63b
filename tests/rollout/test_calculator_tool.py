"""The calculator tool's grammar and environment: calls get values, malformed
calls get an error observation (never an exception), an answer ends the episode."""

from __future__ import annotations

import pytest

from rollout.agent import tool_row_fields, tool_use
from rollout.config import RolloutConfig
from rollout.environments import make_environment
from rollout.tools import BAD_CALL, DEMO_CALLS, DEMO_READS, demonstrations, evaluate, parse_call
from rollout.types import Prompt, Sample, Turn


@pytest.mark.parametrize(
    ("text", "expr", "value"),
    [("?3+4", "3+4", 7), (" ?12-5+1 ", "12-5+1", 8), ("?7", "7", 7), ("? 0-9", "0-9", -9)],
)
def test_calls_parse_and_evaluate(text, expr, value):
    assert parse_call(text) == expr
    assert evaluate(expr) == value


@pytest.mark.parametrize("text", ["?3+", "?+3", "?3++4", "?3*4", "?a", "?1234567", "?3+4 5"])
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


def test_a_bare_call_asks_the_question_itself():
    assert parse_call(" ? ") == ""
    env = make_environment("calculator")
    env.reset(Prompt(index=0, text="37+45=", label="82"))
    assert env.step("?").observation == ":82."
    assert env.step("?1-3").observation == ":-2."  # an expression is still asked as written
    env.reset(Prompt(index=1, text="043:", label="340"))  # no expression to ask
    assert (env.step("?").observation, env.errors) == (BAD_CALL, {BAD_CALL})


def test_demonstrations_mix_calls_reads_and_direct_answers():
    demos = demonstrations(2000, seed=0)
    assert demos == demonstrations(2000, seed=0) != demonstrations(2000, seed=1)
    assert demos[0] == [
        ("prompt", "66+20=", False),
        ("model", "?", False),
        ("tool", ":86.", False),
        ("model", "86", True),
    ]
    calls = [d for d in demos if d[1] == ("model", "?", True)]
    reads = [d for d in demos if d[1] == ("model", "?", False)]
    direct = [d for d in demos if len(d) == 2]
    assert len(calls) + len(reads) + len(direct) == len(demos)
    assert abs(len(calls) / len(demos) - DEMO_CALLS) < 0.01
    assert abs(len(reads) / len(demos) - DEMO_READS) < 0.03
    for d in demos:  # the answer is always the sum, and trained; the observation is never trained
        a, b = d[0][1].rstrip("=").split("+")
        assert d[-1] == ("model", str(int(a) + int(b)), True) and 10 <= int(a) <= 99
        assert all(not trained for role, _, trained in d if role != "model")


def test_unknown_environment_is_refused_at_load():
    with pytest.raises(ValueError, match="rollout.environment 'shell' is not a builtin"):
        RolloutConfig(environment="shell")


def _episode(reward: float, *texts: str) -> Sample:
    """A sample whose turns alternate model, tool, model, ... (the texts in order)."""
    turns = [
        Turn(role="model" if i % 2 == 0 else "tool", ids=[0], text=t) for i, t in enumerate(texts)
    ]
    return Sample(0, 0, [1], [0] * len(turns), [0.0] * len(turns), reward, 0, "stop", turns=turns)


def test_tool_use_counts_well_formed_calls_and_the_correct_answers_after_them():
    samples = [
        _episode(1.0, "?3+4", ":7.", "7"),  # called, then answered right
        _episode(1.0, "7"),  # answered right without the tool
        _episode(0.5, "?3+", BAD_CALL, "?3+4", ":7.", "17"),  # one bad call, one good
        _episode(0.0, "?+", BAD_CALL, "1"),  # only a bad call
    ]
    tools = tool_use(samples, "calculator")
    assert tools == {
        "calls": 2,
        "bad_calls": 2,
        "call_rate": 0.5,
        "correct": 2,
        "correct_after_call": 1,
    }
    assert tool_row_fields(tools) == {"tool_call_rate": 0.5, "tool_correct_after_call": 0.5}
    assert (
        tool_row_fields({**tools, "correct": 0, "correct_after_call": 0})["tool_correct_after_call"]
        is None
    )
    assert tool_row_fields(None) == {}  # single-turn rows get no tool columns
