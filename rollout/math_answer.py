"""The ``math`` reward: the final answer of a response, compared as a number.

``extract_answer`` is the one place that decides what a response answered, in
this order (the first that holds a number wins):

    after the last ``####``        GSM8K's own answer format
    inside the last ``\\boxed{}``  MATH-style answers
    right after the last ``=``     a model that restates the sum ("23 + 58 = 81")
    the last number in the text    a plain answer, or one inside a sentence

Numbers are compared exactly as fractions: ``1,234`` = ``1234``, ``0.50`` = ``1/2``
= ``.5``, ``$12`` = ``12``. A label is either a number or a GSM8K answer ending
in ``#### N`` (``reference_answer``); ``label_error`` is what check_run uses to
refuse any other row before a run starts. Pure functions, no imports beyond stdlib.
"""

from __future__ import annotations

import re
from fractions import Fraction

# A number as written in answers: a sign (not a minus between two operands), a dollar
# sign, thousands commas, decimals, or a fraction a/b.
_NUMBER_RE = re.compile(
    r"(?:(?<![\d)])(?<![\d)]\s)[-+−])?\$?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?"
)


def parse_number(text: str) -> Fraction | None:
    """The value of one written number (``"1,234"``, ``"-0.5"``, ``"3/4"``, ``"$12"``), else None."""
    s = text.strip().replace("−", "-").replace("$", "").replace(",", "").replace(" ", "")
    s = s.rstrip(".")
    if not s:
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _numbers(text: str) -> list[str]:
    return [m.group(0) for m in _NUMBER_RE.finditer(text)]


def _boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}``, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def extract_answer(response: str) -> Fraction | None:
    """The number ``response`` gives as its final answer, None if it gives none."""
    if "####" in response:
        found = _numbers(response.rsplit("####", 1)[1])
        return parse_number(found[0]) if found else None
    boxed = _boxed(response)
    if boxed is not None:
        value = parse_number(boxed.replace("\\frac{", "").replace("}{", "/").replace("}", ""))
        if value is not None:
            return value
        found = _numbers(boxed)
        return parse_number(found[-1]) if found else None
    if "=" in response:
        found = _numbers(response.rsplit("=", 1)[1])
        if found:
            return parse_number(found[0])
    found = _numbers(response)
    return parse_number(found[-1]) if found else None


def reference_answer(label: str) -> Fraction | None:
    """A label's value: a plain number, or the ``#### N`` that ends a GSM8K answer."""
    if "####" in label:
        found = _numbers(label.rsplit("####", 1)[1])
        return parse_number(found[0]) if len(found) == 1 else None
    return parse_number(label)


def label_error(label: str) -> str | None:
    """Why ``label`` cannot be scored by the math reward, or None when it can."""
    if reference_answer(label) is not None:
        return None
    shown = label if len(label) <= 60 else "..." + label[-57:]
    return (
        f"label {shown!r} is neither a number nor a GSM8K answer ending in '#### N'; "
        "end it with '#### <number>' or drop the row"
    )


def math_reward(response: str, label: str) -> float:
    """1.0 when the response's final answer equals the label's, else 0.0."""
    want = reference_answer(label)
    got = extract_answer(response)
    return float(want is not None and got is not None and got == want)
