"""Environments of multi-turn rollouts: the protocol and the registry of builtins.

An environment plays the world around the model for one episode (one sample
of one prompt): ``reset`` takes the prompt, then each ``step`` takes the text
of one model turn and answers a ``Transition``: an observation that goes back
into the context (masked out of the loss), a reward, and whether the episode
is done. When an episode ends, ``answer`` is what the run's reward
(``rollout.reward``) scores against the prompt's label; the sample's reward is
that score plus the environment's step rewards.

An environment must never raise on what the model writes: a malformed turn
gets an error observation. It must be deterministic (a function of the prompt
and the turns), so a retried rollout replays the same episode. Builtins are
named by ``rollout.environment``; ``none`` is the single-turn rollout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from rollout.types import Prompt, Transition


class Environment(Protocol):
    """One episode's world. ``reset`` once, then ``step`` per model turn until done.

    ``errors``: the observations that answer a malformed call; any other
    observation answers a well-formed one (the tool-use metrics count them)."""

    errors: frozenset[str]

    def reset(self, prompt: Prompt) -> None: ...

    def step(self, turn_text: str) -> Transition: ...

    @property
    def answer(self) -> str:
        """What ``rollout.reward`` scores once the episode ended ("" if it gave none)."""
        ...


def _calculator() -> Environment:
    from rollout.tools import CalculatorEnv

    return CalculatorEnv()


BUILTIN_ENVIRONMENTS: dict[str, Callable[[], Environment]] = {"calculator": _calculator}


def make_environment(name: str) -> Environment:
    """A fresh environment of the builtin ``name`` for one episode."""
    if name not in BUILTIN_ENVIRONMENTS:
        raise ValueError(
            f"rollout.environment {name!r} is not a builtin ({', '.join(BUILTIN_ENVIRONMENTS)}); "
            "give one of those, or none for single-turn rollouts"
        )
    return BUILTIN_ENVIRONMENTS[name]()
