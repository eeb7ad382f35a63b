"""Prompt sources: builtin synthetic tasks and JSONL files.

The batch of iteration k is a pure function of (seed, k): builtin tasks derive
prompt i from (seed, i), and JSONL datasets walk a per-epoch permutation. That
is what lets a retried rollout produce the same prompts, and what makes the
data cursor of a checkpoint just the iteration number.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from rollout.config import RolloutConfig
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


BUILTIN_TASKS: dict[str, Callable[[int, int], Prompt]] = {
    "reverse": _reverse_task,
    "copy": _copy_task,
    "add": _add_task,
}


class DatasetError(ValueError):
    """A dataset the user must fix; the message names the file, line and fix."""


def load_jsonl(path: str | Path, input_key: str, label_key: str) -> list[Prompt]:
    p = Path(path)
    if not p.is_file():
        raise DatasetError(
            f"rollout.task {str(p)!r} is neither a builtin task ({', '.join(BUILTIN_TASKS)}) "
            "nor an existing JSONL file"
        )
    prompts: list[Prompt] = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(
                f"{p}:{lineno}: not valid JSON ({e.msg}); one JSON object per line"
            ) from None
        if not isinstance(row, dict):
            raise DatasetError(f"{p}:{lineno}: expected a JSON object, got {type(row).__name__}")
        for key, what in ((input_key, "rollout.input_key"), (label_key, "rollout.label_key")):
            if key not in row:
                raise DatasetError(
                    f"{p}:{lineno}: missing key {key!r}; it has {sorted(row)}; set {what} to the right field"
                )
        prompts.append(
            Prompt(index=len(prompts), text=str(row[input_key]), label=str(row[label_key]))
        )
    if not prompts:
        raise DatasetError(f"{p}: the dataset is empty")
    return prompts


class PromptSource:
    """Gives the prompts of iteration k (1-based) for one run."""

    def __init__(self, cfg: RolloutConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        self._rows: list[Prompt] | None = None
        if cfg.task not in BUILTIN_TASKS:
            self._rows = load_jsonl(cfg.task, cfg.input_key, cfg.label_key)

    def batch(self, k: int) -> list[Prompt]:
        if k < 1:
            raise ValueError(f"iterations start at 1, got {k}")
        start = (k - 1) * self.cfg.batch_size
        indices = range(start, start + self.cfg.batch_size)
        if self._rows is None:
            make = BUILTIN_TASKS[self.cfg.task]
            return [make(self.seed, i) for i in indices]
        return [self._row(i) for i in indices]

    def _row(self, i: int) -> Prompt:
        n = len(self._rows)
        epoch, pos = divmod(i, n)
        order = list(range(n))
        random.Random(f"epoch/{self.seed}/{epoch}").shuffle(order)
        row = self._rows[order[pos]]
        return Prompt(index=i, text=row.text, label=row.label)
