"""evaluate-versions without engines: which versions a selection names (and the
refusal of missing ones), and shards that add up to ``rollout.evaluation``'s
numbers exactly, against the seeded fake engine group of the evaluation tests
(it serves v2)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rollout.config import RolloutConfig
from rollout.evaluation import EvalConfig, eval_prompts, evaluate
from rollout.sharded_eval import ShardScore, score_shard, split, version_scores
from tasks.evaluation.plan import VersionsError, select_versions
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


def _key(
    over: dict,
    n_samples: int = 4,
    temperature: float = 1.0,
    manifest: str = "a" * 64,
    label: str | None = None,
    config: Path | None = None,
) -> str:
    """shard 1 of v3's cache key in an evaluation of the run configured by ``over``."""
    from flows.config import load_config
    from rollout.sharded_eval import prompts_digest
    from tasks.context import RunContext
    from tasks.evaluation.plan import EvalPlan, eval_settings

    cfg = load_config(config, {"run.name": "r", **over})
    prompts = eval_prompts(EvalConfig(size=6), cfg.rollout, cfg.run.seed)
    if label is not None:  # the dataset's content changed: one answer
        prompts[5] = dataclasses.replace(prompts[5], label=label)
    plan = EvalPlan(
        ctx=RunContext(cfg=cfg, base_model_path=""),
        label="reverse-6",
        dataset="reverse",
        versions=[3],
        manifests={3: manifest},
        shards=split(prompts, 2),
        dataset_digest=prompts_digest(prompts),
        settings=eval_settings(cfg, n_samples, temperature),
    )
    return plan.shard_key(3, 1)


def test_a_shard_cache_key_changes_with_whatever_can_change_its_numbers(tmp_path):
    base = _key({})
    assert _key({}) == base  # the same evaluation: the same key (a rerun reuses it)
    # What a shard's numbers do not depend on leaves the key as it is.
    for same in ({"engines.num_cpus_per_engine": 0.5}, {"tasks.retry_delay_s": [1.0]}):
        assert _key(same) == base, same
    changed = {
        "engine count": _key({"engines.num_engines": 2}),
        "engine kind": _key({"engines.kind": "sglang"}),
        "batch": _key({"engines.max_batch_size": 1}),
        "threads": _key({"engines.torch_threads": 2}),
        "dtype": _key({"model.dtype": "bfloat16"}),
        "top_p": _key({"rollout.top_p": 0.9}),
        "new tokens": _key({"rollout.max_new_tokens": 9}),
        "seed": _key({"run.seed": 7}),
        "reward": _key({"rollout.reward": "exact"}),
        "threshold": _key({"eval.pass_threshold": 0.5}),
        "temperature": _key({}, temperature=0.7),
        "n_samples": _key({}, n_samples=8),
        "weights": _key({}, manifest="b" * 64),
        "dataset content": _key({}, label="changed"),
    }
    assert all(k != base for k in changed.values()), [n for n, k in changed.items() if k == base]
    assert len(set(changed.values())) == len(changed)  # each one on its own
    # SGLang's flags (its kernels) are chosen in a config file only.
    triton = tmp_path / "sglang.yaml"
    triton.write_text(
        "engines:\n  kind: sglang\n  sglang:\n    extra_args: [--attention-backend, triton]\n"
    )
    assert _key({}, config=triton) != changed["engine kind"]


def test_a_records_logged_entries_that_do_not_read_count_as_never_logged():
    """evals/<label>.json edited by hand: its unreadable ``logged`` entries make the
    next evaluation log those versions again (a second point at worst), not fail."""
    from tasks.evaluation.record import _logged

    record = {"logged": {"1": ["tensorboard"], "x": ["mlflow"], "2": "tensorboard", "3": [4]}}
    assert _logged(record) == {1: ["tensorboard"]}
    assert _logged({"logged": ["tensorboard"]}) == {} and _logged({}) == {}
