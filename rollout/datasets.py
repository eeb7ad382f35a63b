"""Prompt sources (builtin synthetic tasks, JSONL and Parquet files) and prompt encoding.

The batch of iteration k is a pure function of (seed, k): builtin tasks derive
prompt i from (seed, i), and JSONL datasets walk a per-epoch permutation. That
is what lets a retried rollout produce the same prompts, and what makes the
data cursor of a checkpoint just the iteration number.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rollout.builtin_tasks import BUILTIN_TASKS
from rollout.config import RolloutConfig
from rollout.rewards import LABEL_CHECKS
from rollout.types import Prompt


class DatasetError(ValueError):
    """A dataset the user must fix; the message names the file, line and fix."""


# Why a label cannot be scored by the run's reward (None: it can); rewards.LABEL_CHECKS.
LabelCheck = Callable[[str], "str | None"]


def _prompt(
    row: object,
    where: str,
    input_key: str,
    label_key: str,
    index: int,
    label_check: LabelCheck | None = None,
) -> Prompt:
    """One dataset row as a Prompt; ``where`` ("file:line" or "file: row n") starts
    every error, so a bad row out of millions is found at once."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    values = []
    for key, what in ((input_key, "rollout.input_key"), (label_key, "rollout.label_key")):
        value = _lookup(row, key, where, what)
        if value is None:
            raise DatasetError(f"{where}: key {key!r} is null; fill it in or drop the row")
        # The prompt must be text; a label may be a number (compared as its text).
        allowed = (str,) if key == input_key else (str, int, float)
        if isinstance(value, bool) or not isinstance(value, allowed):
            raise DatasetError(
                f"{where}: key {key!r} is a {type(value).__name__}, expected "
                f"{'a string' if key == input_key else 'a string or a number'}"
            )
        values.append(str(value))
    problem = label_check(values[1]) if label_check is not None else None
    if problem is not None:
        raise DatasetError(f"{where}: key {label_key!r}: {problem}")
    return Prompt(index=index, text=values[0], label=values[1])


def _lookup(row: dict, key: str, where: str, what: str) -> Any:
    """``row[key]``; a dotted key (``reward_model.ground_truth``) that is not a
    field itself walks nested objects, as in verl-style datasets."""
    if key in row:
        return row[key]
    value: Any = row
    for depth, part in enumerate(key.split(".")):
        if not isinstance(value, dict) or part not in value:
            at = ".".join(key.split(".")[:depth]) or "the row"
            has = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise DatasetError(
                f"{where}: missing key {key!r} ({part!r} not in {at}, which has {has}); "
                f"set {what} to the right field"
            )
        value = value[part]
    return value


def load_jsonl(
    path: str | Path, input_key: str, label_key: str, label_check: LabelCheck | None = None
) -> list[Prompt]:
    """Prompts of a JSONL file: one JSON object per line, blank lines skipped."""
    p = Path(path)
    prompts: list[Prompt] = []
    # Split as bytes, decode per line: a bad byte is named by its line, and a
    # U+2028 inside a JSON string (valid JSON) does not end the line.
    for lineno, raw in enumerate(p.read_bytes().split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DatasetError(
                f"{p}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                "save the file as UTF-8"
            ) from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(
                f"{p}:{lineno}: not valid JSON ({e.msg}); one JSON object per line"
            ) from None
        except RecursionError:
            raise DatasetError(
                f"{p}:{lineno}: nested too deeply to read; a row is one flat JSON object "
                "with the prompt and label fields"
            ) from None
        where = f"{p}:{lineno}"
        prompts.append(_prompt(row, where, input_key, label_key, len(prompts), label_check))
    return prompts


def load_parquet(
    path: str | Path, input_key: str, label_key: str, label_check: LabelCheck | None = None
) -> list[Prompt]:
    """Prompts of a Parquet file, one per row (rows numbered from 1 in errors)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(
            f"{path}: reading Parquet needs pyarrow; pip install 'prefect-rl[data]'"
        ) from None
    p = Path(path)
    try:
        table = pq.read_table(p)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise DatasetError(f"{p}: not a readable Parquet file ({e})") from None
    columns = []
    for key, what in ((input_key, "rollout.input_key"), (label_key, "rollout.label_key")):
        # A dotted key names a field inside a struct column (checked per row).
        column = key if key in table.column_names else key.split(".")[0]
        if column not in table.column_names:
            raise DatasetError(
                f"{p}: no column {key!r}; it has {table.column_names}; set {what} to the right column"
            )
        columns.append(column)
    rows = table.select(sorted(set(columns))).to_pylist()
    return [
        _prompt(r, f"{p}: row {i}", input_key, label_key, i - 1, label_check)
        for i, r in enumerate(rows, 1)
    ]


LOADERS: dict[str, Callable[[str | Path, str, str, LabelCheck | None], list[Prompt]]] = {
    ".jsonl": load_jsonl,
    ".json": load_jsonl,
    ".parquet": load_parquet,
}


def load_prompts(
    path: str | Path,
    input_key: str,
    label_key: str,
    key: str = "rollout.task",
    label_check: LabelCheck | None = None,
) -> list[Prompt]:
    """Prompts of a dataset file, by its suffix (``LOADERS``); never empty. ``key``
    is the setting that named the file, for the error when it is no dataset;
    ``label_check`` refuses a label the run's reward cannot score (file and line)."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(
            f"{key} {str(p)!r} is neither a builtin task ({', '.join(BUILTIN_TASKS)}) "
            f"nor an existing dataset file ({', '.join(LOADERS)})"
        )
    loader = LOADERS.get(p.suffix.lower())
    if loader is None:
        raise DatasetError(
            f"{key}: {p}: unknown dataset format {p.suffix!r}; give a {' or '.join(LOADERS)} file"
        )
    try:
        prompts = loader(p, input_key, label_key, label_check)
    except DatasetError as e:
        raise DatasetError(f"{key}: {e}") from None
    if not prompts:
        raise DatasetError(f"{key}: {p}: the dataset is empty")
    return prompts


def encode_prompt(tokenizer: Any, text: str, chat_template: bool) -> list[int]:
    """Token ids of a prompt. With ``chat_template`` the text is the user turn of
    the tokenizer's chat template, ending in the assistant's generation prompt;
    the template writes its own special tokens, so none are added on top."""
    if not chat_template:
        return list(tokenizer(text)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError(
            f"rollout.chat_template is on, but the tokenizer of {tokenizer.name_or_path!r} "
            "has no chat template; set rollout.chat_template: false for a base model"
        )
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def encode_observation(tokenizer: Any, text: str, chat_template: bool, ended: bool) -> list[int]:
    """Token ids that follow a model turn in a multi-turn episode: the environment's
    ``text`` as is, or with ``chat_template`` as the next user turn of the template,
    ending in the assistant's generation prompt. The model's turn stopped at the
    template's end token (``ended``) or is closed with it here. The template is
    rendered for a conversation one turn shorter and one longer, and the tokens are
    the difference after the end token: what the template writes between turns."""
    if not chat_template:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    eos = tokenizer.eos_token
    before = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    short = tokenizer.apply_chat_template(before, tokenize=False)
    long = tokenizer.apply_chat_template(
        [*before, {"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    cut = short.rfind(eos) if eos else -1
    if cut < 0 or not long.startswith(short[: cut + len(eos)]):
        raise DatasetError(
            f"the chat template of {tokenizer.name_or_path!r} does not end a turn with its eos "
            f"token {eos!r}, or renders earlier turns differently once one follows; multi-turn "
            "episodes need both: set rollout.chat_template: false"
        )
    ids = list(tokenizer(long[cut + len(eos) :], add_special_tokens=False)["input_ids"])
    return ids if ended else [tokenizer.eos_token_id, *ids]


class PromptSource:
    """Gives the prompts of iteration k (1-based) for one run."""

    def __init__(self, cfg: RolloutConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        self._rows: list[Prompt] | None = None
        if cfg.task not in BUILTIN_TASKS:
            check = LABEL_CHECKS.get(cfg.reward)
            self._rows = load_prompts(cfg.task, cfg.input_key, cfg.label_key, label_check=check)

    def batch(self, k: int) -> list[Prompt]:
        if k < 1:
            raise ValueError(f"iterations start at 1, got {k}")
        start = (k - 1) * self.cfg.batch_size
        return self.prompts(range(start, start + self.cfg.batch_size))

    def prompts(self, indices: Iterable[int]) -> list[Prompt]:
        """The prompts at ``indices`` of the run's endless prompt stream (a builtin
        task's index, or a dataset row through its epoch's permutation)."""
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
