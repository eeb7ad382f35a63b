"""Reward functions: ``fn(response: str, label: str) -> float`` in [0, 1].

Builtins are named in ``rollout.reward``; anything else is ``module:function``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

RewardFn = Callable[[str, str], float]


def match_reward(response: str, label: str) -> float:
    """Fraction of label positions the response gets right; extra characters
    after the label cost as much as wrong ones, so the policy must also stop."""
    if not label:
        return float(response == "")
    hits = sum(1 for a, b in zip(response, label) if a == b)
    return hits / max(len(label), len(response))


def exact_reward(response: str, label: str) -> float:
    return float(response.strip() == label.strip())


BUILTIN_REWARDS: dict[str, RewardFn] = {"match": match_reward, "exact": exact_reward}


def load_reward(spec: str) -> RewardFn:
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(
            f"rollout.reward {spec!r} is not a builtin ({', '.join(BUILTIN_REWARDS)}); "
            "give one of those or module:function"
        )
    mod_name, fn_name = spec.split(":", 1)
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"rollout.reward {spec!r} cannot be imported: {e}") from e
    if not callable(fn):
        raise ValueError(f"rollout.reward {spec!r} is not callable")
    return fn
