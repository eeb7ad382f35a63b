"""The calculator tool and the environment that offers it (``rollout.environment:
calculator``), small enough for the tiny model to learn on CPU (``add2`` task,
configs/tiny-tool.yaml), and the demonstrations that warm-start it.

Tool-call grammar, over one model turn's text (surrounding spaces ignored)::

    turn    := call | answer
    call    := "?" [expr]
    expr    := number (op number)*
    op      := "+" | "-"
    number  := digit{1,6}
    answer  := any text not starting with "?"

A call is answered with the observation ``":" value "."`` (``?3+4`` gets
``:7.``). A bare ``?`` asks the question itself: the prompt's text before its
``=`` (``12+34=`` then ``?`` gets ``:46.``), so a call can be one token. A
turn that starts with ``?`` but breaks the grammar (or a bare ``?`` on a
prompt that is no expression) gets ``:bad.`` and the episode goes on. An answer ends the episode; its text is what
``rollout.reward`` scores. The observations use only characters of the tiny
model's vocabulary. ``max_turns`` in the rollout bounds the episode: a call
on the last turn ends it without an answer.
"""

from __future__ import annotations

import random
import re

from rollout.builtin_tasks import BUILTIN_TASKS
from rollout.types import Prompt, Transition

CALL = "?"
BAD_CALL = ":bad."
_EXPR = re.compile(r"[0-9]{1,6}(?:[+-][0-9]{1,6})*")
_TOKEN = re.compile(r"[+-]?[0-9]+")


def parse_call(text: str) -> str | None:
    """The expression of a tool call ("" for a bare ``?``), or None when ``text``
    is not a call at all. ValueError when it starts like a call but breaks the grammar."""
    text = text.strip()
    if not text.startswith(CALL):
        return None
    expr = text[len(CALL) :].strip()
    if expr and not _EXPR.fullmatch(expr):
        raise ValueError(f"not a calculator expression: {expr!r}")
    return expr


def question_expression(prompt_text: str) -> str | None:
    """What a bare ``?`` asks: the prompt's text before its first ``=``, when that
    is a calculator expression (``12+34=`` gives ``12+34``); else None."""
    expr = prompt_text.split("=", 1)[0].strip()
    return expr if _EXPR.fullmatch(expr) else None


def evaluate(expr: str) -> int:
    """The value of a grammatical expression (``parse_call``'s): a sum of signed numbers."""
    return sum(int(t) for t in _TOKEN.findall(expr))


class CalculatorEnv:
    """One episode with a calculator: calls get their value, an answer ends it."""

    errors = frozenset({BAD_CALL})

    def __init__(self) -> None:
        self._answer = ""
        self._question: str | None = None

    def reset(self, prompt: Prompt) -> None:
        self._answer = ""
        self._question = question_expression(prompt.text)

    def step(self, turn_text: str) -> Transition:
        try:
            expr = parse_call(turn_text)
        except ValueError:
            return Transition(observation=BAD_CALL, reward=0.0, done=False)
        if expr is None:
            self._answer = turn_text.strip()
            return Transition(observation="", reward=0.0, done=True)
        expr = expr or self._question
        if expr is None:  # a bare ? on a prompt that is no expression
            return Transition(observation=BAD_CALL, reward=0.0, done=False)
        return Transition(observation=f":{evaluate(expr)}.", reward=0.0, done=False)

    @property
    def answer(self) -> str:
        return self._answer


# One segment of a demonstration: (role, text, trained). Roles as in a Turn, plus
# "prompt"; a model turn ends with the tokenizer's eos, as the engines end it.
Segment = tuple[str, str, bool]

# The demonstrations' mix: how to call (few, so that calling is rare before RL and
# RL has it to learn), how to read an observation, and direct answers.
DEMO_CALLS = 0.02
DEMO_READS = 0.60


def demonstrations(count: int, seed: int) -> list[list[Segment]]:
    """Supervised examples of the calculator on the ``add2`` task (``model.warm_start:
    calculator``): a share DEMO_CALLS teaches the bare call ``?`` and the answer
    read from its observation; a share DEMO_READS has the call in the context (not
    trained) and teaches reading the observation only; the rest answer directly.
    Questions are the task's prompts at negative indices, never a run's prompts."""
    rng = random.Random(f"calculator-demos/{seed}")
    out = []
    for i in range(count):
        p = BUILTIN_TASKS["add2"](seed, -1 - i)
        u = rng.random()
        if u < DEMO_CALLS + DEMO_READS:
            call = [("model", CALL, u < DEMO_CALLS), ("tool", f":{p.label}.", False)]
        else:
            call = []
        out.append([("prompt", p.text, False), *call, ("model", p.label, True)])
    return out
