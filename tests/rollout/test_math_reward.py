"""The math reward and the tasks it scores: what a response answered (a table of
cases), arithmetic word problems, and GSM8K-format files whose rows without
'#### N' are refused by check_run, naming file and line, before any run state."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

from flows.config import ConfigError, load_config
from rollout.builtin_tasks import BUILTIN_TASKS
from rollout.datasets import PromptSource
from rollout.math_answer import extract_answer, math_reward, reference_answer
from tasks.prepare import check_run


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("81", 81),
        ("81.", 81),
        ("The answer is 81", 81),
        ("23 + 58 = 81", 81),  # the model restates the sum: read after '='
        ("23 + 58 = 81 because 3 + 8 = 11 and carry", 11),  # the last '=' wins
        ("First 12, then 30. #### 42", 42),  # GSM8K: after '####', whatever came before
        ("#### 1,234", 1234),  # thousands commas
        ("so the total is \\boxed{17}.", 17),
        ("\\boxed{\\frac{3}{4}}", Fraction(3, 4)),
        ("58 - 23 = 35", 35),
        ("58 - 23", 23),  # no '=': the last number, and the minus is an operator
        ("It is -5", -5),
        ("0.50", Fraction(1, 2)),
        ("$12.00", 12),
        ("3/4", Fraction(3, 4)),
        ("no number here", None),
        ("", None),
    ],
)
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("23 + 58 = 81", "81", 1.0),
        ("81", "80", 0.0),
        ("The answer is 72.", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),
        ("1234", "#### 1,234", 1.0),
        ("I don't know", "81", 0.0),
        ("81", "eighty-one", 0.0),  # a label that is no number scores nothing
    ],
)
def test_math_reward(response, label, reward):
    assert math_reward(response, label) == reward


def test_reference_answer_takes_the_gsm8k_final_line():
    assert reference_answer("48/2 = 24\n24 + 48 = 72\n#### 72") == 72
    assert reference_answer("#### ") is None
    assert reference_answer("no marker") is None


def test_arithmetic_tasks_are_word_problems_with_numeric_labels():
    for name in ("add-2d", "sub-2d", "mul-1d", "add-4d"):
        assert name in BUILTIN_TASKS
    cfg = load_config("configs/tiny-cpu.yaml", {"rollout.task": "add-2d"}).rollout
    first = PromptSource(cfg, seed=0).batch(1)
    again = PromptSource(cfg, seed=0).batch(1)
    assert first == again  # a function of (seed, k): a retried rollout asks the same
    p = first[0]
    assert p.text.startswith("What is ") and p.text.endswith("? Answer with just the number.")
    a, _, b = p.text[len("What is ") : -len("? Answer with just the number.")].split()
    assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99 and int(p.label) == int(a) + int(b)
    subs = PromptSource(cfg.model_copy(update={"task": "sub-3d"}), 0).batch(1)
    assert all(int(s.label) >= 0 for s in subs)  # the larger operand first
    assert math_reward(f"{a} + {b} = {p.label}", p.label) == 1.0


def _gsm8k(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "What is 6 times 7?", "answer": "6 * 7 = 42\n#### 42"},
]


def test_a_gsm8k_row_without_its_answer_is_refused_by_check_run(tmp_path):
    sets = {
        "storage.root": str(tmp_path / "runs"),
        "rollout.input_key": "question",
        "rollout.label_key": "answer",
        "rollout.reward": "math",
    }
    bad = _gsm8k(
        tmp_path / "gsm8k.jsonl", [*GSM8K_ROWS, {"question": "How many?", "answer": "about 7"}]
    )
    with pytest.raises(ConfigError) as e:
        check_run(load_config("configs/tiny-cpu.yaml", {**sets, "rollout.task": bad}))
    assert f"{bad}:3" in str(e.value) and "'#### <number>'" in str(e.value)
    assert not (tmp_path / "runs").exists()  # refused before any run state
    good = _gsm8k(tmp_path / "good.jsonl", GSM8K_ROWS)
    cfg = load_config("configs/tiny-cpu.yaml", {**sets, "rollout.task": good})
    assert check_run(cfg)
    prompts = PromptSource(cfg.rollout, seed=0).prompts(range(2))
    assert {math_reward("#### 7", p.label) for p in prompts} == {0.0, 1.0}
    # Another reward does not need the marker: the same file is read as before.
    assert check_run(
        load_config(
            "configs/tiny-cpu.yaml", {**sets, "rollout.task": bad, "rollout.reward": "exact"}
        )
    )


def test_a_gsm8k_parquet_file_reads_as_its_jsonl_twin_and_names_a_bad_row(tmp_path):
    """GSM8K as HF ships it (Parquet, ``question`` / ``answer``): the same prompts and
    labels as the JSONL file, and a row without ``#### N`` refused by its row number."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def parquet(path: Path, rows: list[dict]) -> str:
        pq.write_table(pa.Table.from_pylist(rows), path)
        return str(path)

    sets = {
        "storage.root": str(tmp_path / "runs"),
        "rollout.input_key": "question",
        "rollout.label_key": "answer",
        "rollout.reward": "math",
    }
    files = (_gsm8k(tmp_path / "g.jsonl", GSM8K_ROWS), parquet(tmp_path / "g.parquet", GSM8K_ROWS))
    read = []
    for f in files:
        cfg = load_config("configs/tiny-cpu.yaml", {**sets, "rollout.task": f})
        assert check_run(cfg)
        read.append(
            [(p.text, p.label) for p in PromptSource(cfg.rollout, seed=0).prompts(range(2))]
        )
    assert read[0] == read[1] and {math_reward("42", label) for _, label in read[1]} == {0.0, 1.0}
    bad = parquet(
        tmp_path / "bad.parquet", [*GSM8K_ROWS, {"question": "How many?", "answer": "7?"}]
    )
    with pytest.raises(ConfigError) as e:
        check_run(load_config("configs/tiny-cpu.yaml", {**sets, "rollout.task": bad}))
    assert f"{bad}: row 3: key 'answer'" in str(e.value) and "'#### <number>'" in str(e.value)
