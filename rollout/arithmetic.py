"""Arithmetic word problems for instruct models: builtin tasks ``add-Nd``,
``sub-Nd`` and ``mul-Nd`` (N = 1..4 digits per operand), scored by the ``math``
reward.

Each prompt is phrased as a question in words ("What is 23 + 58? Answer with
just the number.") for a chat template to wrap, and its label is the number.
Like every builtin task, prompt i is a pure function of (seed, i). Subtraction
puts the larger operand first, so answers are never negative.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial

from rollout.types import Prompt

OPERATIONS: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "add": ("+", lambda a, b: a + b),
    "sub": ("-", lambda a, b: a - b),
    "mul": ("*", lambda a, b: a * b),
}
MAX_DIGITS = 4
QUESTION = "What is {a} {symbol} {b}? Answer with just the number."


def arithmetic_prompt(op: str, digits: int, seed: int, index: int) -> Prompt:
    """Prompt ``index`` of family ``{op}-{digits}d``: operands of exactly ``digits``
    digits (0-9 for one digit)."""
    symbol, fn = OPERATIONS[op]
    rng = random.Random(f"{op}-{digits}d/{seed}/{index}")
    low = 0 if digits == 1 else 10 ** (digits - 1)
    a, b = rng.randrange(low, 10**digits), rng.randrange(low, 10**digits)
    if op == "sub" and b > a:
        a, b = b, a
    return Prompt(index=index, text=QUESTION.format(a=a, symbol=symbol, b=b), label=str(fn(a, b)))


ARITHMETIC_TASKS: dict[str, Callable[[int, int], Prompt]] = {
    f"{op}-{d}d": partial(arithmetic_prompt, op, d)
    for op in OPERATIONS
    for d in range(1, MAX_DIGITS + 1)
}
