"""Reward functions: ``fn(response: str, label: str) -> float`` in [0, 1], and
the scoring of a batch's samples with them (``score``).

Builtins are named in ``rollout.reward``. Anything else is ``module:function``
from a module the config file trusts (``rollout.trusted_reward_modules``): a
reward runs inside the rollout step, so naming one is running code, and only
the config file's author may choose which code. An ``http://`` or ``https://``
``rollout.reward`` is a reward server (``rollout.remote_reward``).

``score`` is the one way samples are scored: the rollout procedure calls it in
its own process, or the step fans it out over Ray tasks (``Scorer``, given by
the caller), each task calling ``score`` on its share.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from rollout.math_answer import label_error, math_reward
from rollout.remote_reward import RemoteRewardConfig, is_url, post_rewards

RewardFn = Callable[[str, str], float]
# Scores a batch: one item per sample ({"prompt", "response", "label", ...}), one reward each.
Scorer = Callable[[list[dict[str, Any]]], list[float]]

SIGNATURE = "(response: str, label: str) -> float"


def match_reward(response: str, label: str) -> float:
    """Fraction of label positions the response gets right; extra characters
    after the label cost as much as wrong ones, so the policy must also stop."""
    if not label:
        return float(response == "")
    hits = sum(1 for a, b in zip(response, label) if a == b)
    return hits / max(len(label), len(response))


def exact_reward(response: str, label: str) -> float:
    return float(response.strip() == label.strip())


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "match": match_reward,
    "exact": exact_reward,
    "math": math_reward,  # the final answer as a number (rollout.math_answer)
}
# Builtin rewards that need labels of a given form: why a label cannot be scored,
# checked on every dataset row before a run starts (tasks.prepare.check_datasets).
LABEL_CHECKS: dict[str, Callable[[str], str | None]] = {"math": label_error}


def is_trusted(module: str, trusted: Sequence[str]) -> bool:
    """True if ``module`` is one of ``trusted`` or inside one of those packages."""
    return any(module == t or module.startswith(t + ".") for t in trusted)


def check_signature(fn: object, spec: str) -> None:
    """Refuse anything but ``fn(response: str, label: str) -> float``.

    Checked before the first rollout, so a function that merely happens to be
    importable (``shutil:rmtree``) never gets called with generated text."""
    fix = f"rollout.reward {spec!r} must be a function {SIGNATURE}"
    if not inspect.isfunction(fn):
        raise ValueError(f"{fix}; it is a {type(fn).__name__}")
    try:
        hints = typing.get_type_hints(fn)
        params = list(inspect.signature(fn).parameters.values())
    except (NameError, TypeError, ValueError) as e:
        raise ValueError(f"{fix}; its annotations cannot be read ({e})") from None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_rest = [
        p
        for p in params[2:]
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if len(positional) < 2 or params[:2] != positional[:2] or required_rest:
        raise ValueError(f"{fix}; it takes {inspect.signature(fn)}")
    got = [hints.get(p.name) for p in positional[:2]] + [hints.get("return")]
    if got != [str, str, float]:
        raise ValueError(f"{fix}; it is annotated {inspect.signature(fn)}")


def load_reward(spec: str, trusted: Sequence[str] = ()) -> RewardFn:
    """The reward function ``spec`` names: a builtin, or ``module:function``
    from a module under ``trusted``, checked for the reward signature."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(
            f"rollout.reward {spec!r} is not a builtin ({', '.join(BUILTIN_REWARDS)}); "
            "give one of those or module:function"
        )
    mod_name, fn_name = spec.split(":", 1)
    # Checked before the import: importing a module already runs its code.
    if not is_trusted(mod_name, trusted):
        raise ValueError(
            f"rollout.reward {spec!r}: module {mod_name!r} is not trusted; list it (or its package) "
            "under rollout.trusted_reward_modules in the config file"
        )
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"rollout.reward {spec!r} cannot be imported: {e}") from e
    check_signature(fn, spec)
    return fn


class RewardSettings(Protocol):
    """What scoring reads of the rollout section (``rollout.config.RolloutConfig``,
    which imports this module to check ``rollout.reward`` at load)."""

    reward: str
    trusted_reward_modules: list[str]
    remote_reward: RemoteRewardConfig


def score(cfg: RewardSettings, items: list[dict[str, Any]]) -> list[float]:
    """The reward of each item (``response`` against ``label``): posted to the reward
    server, or the reward function applied in this process."""
    if is_url(cfg.reward):
        return post_rewards(cfg.reward, cfg.remote_reward, items)
    fn = load_reward(cfg.reward, cfg.trusted_reward_modules)
    return [float(fn(i["response"], i["label"])) for i in items]
