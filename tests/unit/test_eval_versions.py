"""evaluate-versions without engines: which versions a selection names (and the
refusal of missing ones), and shards that add up to ``rollout.evaluation``'s
numbers exactly, against the seeded fake engine group of the evaluation tests
(it serves v2)."""

from __future__ import annotations

import pytest

from rollout.config import RolloutConfig
from rollout.evaluation import EvalConfig, eval_prompts, evaluate
from rollout.sharded_eval import ShardScore, score_shard, split, version_scores
from tasks.eval_plan import VersionsError, select_versions
from tests.unit.test_dynamic_sampling import seeded_generate_groups
from tests.unit.test_procedure import FakeTokenizer


def test_a_selection_names_committed_versions_or_is_refused_naming_them():
    committed = [0, 1, 2, 5, 6]
    assert select_versions("1, 5", committed, "r") == [1, 5]
    assert select_versions("0..2", committed, "r") == [0, 1, 2]
    assert select_versions("newest 2", committed, "r") == [5, 6]
    assert select_versions("Newest 9", committed, "r") == committed
    assert select_versions("all", committed, "r") == committed
    with pytest.raises(VersionsError, match=r"no committed version v3, v4 .*\[0, 1, 2, 5, 6\]"):
        select_versions("2..5", committed, "r")
    with pytest.raises(VersionsError, match="is not a list"):
        select_versions("latest", committed, "r")
    with pytest.raises(VersionsError, match="start is after its end"):
        select_versions("4..2", committed, "r")


def test_shards_add_up_to_the_single_evaluation_exactly():
    cfg, rollout = EvalConfig(size=10, n_samples=4), RolloutConfig()
    gen, _ = seeded_generate_groups()
    whole = evaluate(cfg, rollout, 5, 2, 2, FakeTokenizer(), gen, restart=lambda i: None)
    prompts = eval_prompts(cfg, rollout, 5)
    shards = [
        score_shard(rollout, cfg.pass_threshold, 4, 5, 2, s, part, FakeTokenizer(), gen, None)
        for s, part in enumerate(split(prompts, 3))
    ]
    assert [len(s.prompt_indices) for s in shards] == [3, 3, 3, 1]
    merged = version_scores(list(reversed(shards)))  # any order
    assert {k: merged[k] for k in ("pass_at_1_greedy", "pass_at_1", "pass_at_k")} == {
        k: whole[k] for k in ("pass_at_1_greedy", "pass_at_1", "pass_at_k")
    }
    assert ShardScore.from_json(shards[0].to_json()) == shards[0]  # a task result round-trips
    with pytest.raises(ValueError, match="give every shard of one version once"):
        version_scores(shards[:2] + shards[3:])
