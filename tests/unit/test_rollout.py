"""Prompt sources, rewards and per-sample seeds."""

import json

import pytest

from rollout.config import RolloutConfig
from rollout.datasets import DatasetError, PromptSource
from rollout.rewards import exact_reward, load_reward, match_reward
from rollout.seeding import sample_seed


def test_builtin_batch_is_a_function_of_seed_and_iteration():
    cfg = RolloutConfig(batch_size=4)
    a, b = PromptSource(cfg, seed=1), PromptSource(cfg, seed=1)
    assert a.batch(3) == b.batch(3)
    assert [p.index for p in a.batch(2)] == [4, 5, 6, 7]
    assert a.batch(1) != PromptSource(cfg, seed=2).batch(1)
    for p in a.batch(1):
        assert p.label == p.text[:-1][::-1]  # reverse task: the answer depends on the prompt


def test_jsonl_dataset_cycles_through_epochs(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"{i}+0=", "a": str(i)}) for i in range(3)))
    cfg = RolloutConfig(task=str(path), input_key="q", label_key="a", batch_size=3)
    src = PromptSource(cfg, seed=0)
    first, second = src.batch(1), src.batch(2)
    assert sorted(p.label for p in first) == ["0", "1", "2"]
    assert sorted(p.label for p in second) == ["0", "1", "2"]
    assert [p.index for p in second] == [3, 4, 5]


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "empty"),
        ('{"q": "1"}\n', "missing key 'a'"),
        ("not json\n", "not valid JSON"),
        ("[1, 2]\n", "expected a JSON object"),
    ],
)
def test_bad_jsonl_is_named(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        PromptSource(RolloutConfig(task=str(path), input_key="q", label_key="a"), seed=0)


def test_unknown_task_names_builtins():
    with pytest.raises(DatasetError, match="neither a builtin task"):
        PromptSource(RolloutConfig(task="nope"), seed=0)


def test_rewards():
    assert match_reward("321", "321") == 1.0
    assert match_reward("3", "321") == pytest.approx(1 / 3)
    assert match_reward("32100", "321") == pytest.approx(3 / 5)  # extra output costs
    assert match_reward("", "321") == 0.0
    assert exact_reward(" 12 ", "12") == 1.0
    assert load_reward("match") is match_reward
    assert load_reward("rollout.rewards:exact_reward", trusted=["rollout"]) is exact_reward
    with pytest.raises(ValueError, match="module:function"):
        load_reward("nope")
    with pytest.raises(ValueError, match="cannot be imported"):
        load_reward("no_such_module:fn", trusted=["no_such_module"])


def test_sample_seeds_are_stable_and_distinct():
    assert sample_seed(0, 1, 2, 3) == sample_seed(0, 1, 2, 3)
    seeds = {sample_seed(0, k, p, j) for k in range(3) for p in range(4) for j in range(4)}
    assert len(seeds) == 48
