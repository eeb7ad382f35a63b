"""The calculator tool and the environment that offers it (``rollout.environment:
calculator``), small enough for the tiny model to learn on CPU (``add`` task).

Tool-call grammar, over one model turn's text (surrounding spaces ignored)::

    turn    := call | answer
    call    := "?" expr
    expr    := number (op number)*
    op      := "+" | "-"
    number  := digit{1,6}
    answer  := any text not starting with "?"

A call is answered with the observation ``":" value "."`` (``?3+4`` gets
``:7.``); a turn that starts with ``?`` but breaks the grammar gets ``:bad.``
and the episode goes on. An answer ends the episode; its text is what
``rollout.reward`` scores. The observations use only characters of the tiny
model's vocabulary. ``max_turns`` in the rollout bounds the episode: a call
on the last turn ends it without an answer.
"""

from __future__ import annotations

import re

from rollout.environments import Transition
from rollout.types import Prompt

CALL = "?"
BAD_CALL = ":bad."
_EXPR = re.compile(r"[0-9]{1,6}(?:[+-][0-9]{1,6})*")
_TOKEN = re.compile(r"[+-]?[0-9]+")


def parse_call(text: str) -> str | None:
    """The expression of a tool call, or None when ``text`` is not a call at all.
    ValueError when it starts like a call but breaks the grammar."""
    text = text.strip()
    if not text.startswith(CALL):
        return None
    expr = text[len(CALL) :].strip()
    if not _EXPR.fullmatch(expr):
        raise ValueError(f"not a calculator expression: {expr!r}")
    return expr


def evaluate(expr: str) -> int:
    """The value of a grammatical expression (``parse_call``'s): a sum of signed numbers."""
    return sum(int(t) for t in _TOKEN.findall(expr))


class CalculatorEnv:
    """One episode with a calculator: calls get their value, an answer ends it."""

    errors = frozenset({BAD_CALL})

    def __init__(self) -> None:
        self._answer = ""

    def reset(self, prompt: Prompt) -> None:
        self._answer = ""

    def step(self, turn_text: str) -> Transition:
        try:
            expr = parse_call(turn_text)
        except ValueError:
            return Transition(observation=BAD_CALL, reward=0.0, done=False)
        if expr is None:
            self._answer = turn_text.strip()
            return Transition(observation="", reward=0.0, done=True)
        return Transition(observation=f":{evaluate(expr)}.", reward=0.0, done=False)

    @property
    def answer(self) -> str:
        return self._answer
