"""The builtin tasks: prompts made from (seed, index) alone, no file.

``reverse``, ``copy``, ``add``, ``add2`` for the tiny character model, and the
arithmetic questions in words for instruct models (``rollout.arithmetic``). A
leaf of the package: datasets, tools and evaluation take the table from here.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from rollout.arithmetic import ARITHMETIC_TASKS
from rollout.types import Prompt

DIGITS = "01234"  # a small alphabet keeps the tiny task learnable in minutes on CPU


def _reverse_task(seed: int, index: int) -> Prompt:
    rng = random.Random(f"reverse/{seed}/{index}")
    s = "".join(rng.choice(DIGITS) for _ in range(3))
    return Prompt(index=index, text=f"{s}:", label=s[::-1])


def _copy_task(seed: int, index: int) -> Prompt:
    rng = random.Random(f"copy/{seed}/{index}")
    s = "".join(rng.choice(DIGITS) for _ in range(3))
    return Prompt(index=index, text=f"{s}:", label=s)


def _add_task(seed: int, index: int) -> Prompt:
    rng = random.Random(f"add/{seed}/{index}")
    a, b = rng.randrange(10), rng.randrange(10)
    return Prompt(index=index, text=f"{a}+{b}=", label=str(a + b))


def _add2_task(seed: int, index: int) -> Prompt:
    # Two-digit operands: 8100 sums, more than the tiny model memorises in a short
    # run, so the calculator (rollout.environment: calculator) is the way to the answer.
    rng = random.Random(f"add2/{seed}/{index}")
    a, b = rng.randrange(10, 100), rng.randrange(10, 100)
    return Prompt(index=index, text=f"{a}+{b}=", label=str(a + b))


BUILTIN_TASKS: dict[str, Callable[[int, int], Prompt]] = {
    "reverse": _reverse_task,
    "copy": _copy_task,
    "add": _add_task,
    "add2": _add2_task,
    **ARITHMETIC_TASKS,  # add-2d, sub-1d, mul-3d, ...: questions in words for instruct models
}
