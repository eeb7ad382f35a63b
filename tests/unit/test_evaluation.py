"""Evaluation during training (``rollout.evaluation``, the evaluate step): the
pass@k estimator on hand-computed numbers, which prompts are evaluated, the
scores through the rollout procedure against a fake engine group (engines need
Ray), where the step sits in the plan, and the eval curves in the report."""

from __future__ import annotations

import json

import pytest

from flows.report import eval_points, reward_curve_png, summary_markdown
from rollout.config import RolloutConfig
from rollout.evaluation import (
    EVAL_INDEX_BASE,
    EvalConfig,
    eval_prompts,
    evaluate,
    pass_at_k,
    row_fields,
)
from tasks import plan
from tests.unit.test_dynamic_sampling import seeded_generate_groups
from tests.unit.test_plan import make_ctx, waits
from tests.unit.test_procedure import FakeTokenizer


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # c / n
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2) / C(4,2)
    assert pass_at_k(4, 2, 4) == 1.0  # any passing answer among all n
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3) / C(5,3)


def test_builtin_prompts_are_held_out_and_a_file_gives_its_first_rows(tmp_path):
    rollout = RolloutConfig(task="reverse")
    prompts = eval_prompts(EvalConfig(size=5), rollout, seed=3)
    assert [p.index for p in prompts] == list(range(EVAL_INDEX_BASE, EVAL_INDEX_BASE + 5))
    assert prompts == eval_prompts(EvalConfig(size=5), rollout, seed=3)  # the same every time
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"q": f"{i}:", "a": str(i)}) + "\n" for i in range(9)))
    rollout = RolloutConfig(input_key="q", label_key="a")
    rows = eval_prompts(EvalConfig(dataset=str(path), size=3), rollout, seed=3)
    assert [(p.text, p.label) for p in rows] == [("0:", "0"), ("1:", "1"), ("2:", "2")]


def test_an_unknown_dataset_is_refused_at_load():
    from flows.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="eval.dataset 'revers' is neither a builtin task"):
        load_config(None, {"eval.dataset": "revers", "eval.interval": 1})


def test_greedy_and_sampled_scores():
    """The fake answers right in every sample of a group or in its even samples
    (by the group's seed); greedy asks one answer, which is always sample 0."""
    gen, calls = seeded_generate_groups()
    cfg = EvalConfig(size=6, n_samples=4)
    out = evaluate(cfg, RolloutConfig(), 5, 2, 2, FakeTokenizer(), gen, restart=lambda i: None)
    assert calls == [6, 6]  # one greedy round, one sampled round
    assert out["pass_at_1_greedy"] == 1.0  # sample 0 is right in both kinds of group
    assert 0.5 <= out["pass_at_1"] <= 1.0  # half right, or all
    assert out["pass_at_k"] == 1.0
    assert row_fields(out) == {
        "eval_pass_at_1_greedy": 1.0,
        "eval_pass_at_1": out["pass_at_1"],
        "eval_pass_at_k": 1.0,
        "eval_k": 4,
    }
    assert row_fields({"evaluated": False}) == {}


def test_the_plan_evaluates_due_iterations_after_every_verify(tmp_path):
    ctx = make_ctx(tmp_path, **{"eval.interval": 2, "run.iterations": 5})
    assert "evaluate@3" not in waits(plan.iteration_plan(ctx, 3))
    for k in (2, 4, 5):  # every interval, and the last iteration
        nodes = waits(plan.iteration_plan(ctx, k))
        assert nodes[f"evaluate@{k}"] == (f"verify-e0@{k}", f"verify-e1@{k}")
        assert nodes[f"iteration@{k}"] == (f"evaluate@{k}",)


def test_the_report_shows_the_eval_curves():
    rows = [{"iteration": k, "reward_mean": 0.1 * k} for k in range(1, 5)]
    rows[1].update(eval_pass_at_1_greedy=0.2, eval_pass_at_1=0.1, eval_pass_at_k=0.3, eval_k=4)
    png = reward_curve_png(rows, "t")
    assert png.startswith(b"\x89PNG") and png != reward_curve_png(rows[:1], "t")
    md = summary_markdown("r", "/x", rows, [4], {}, {0: 4})
    assert "pass@1 greedy 0.200, pass@1 sampled 0.100, pass@4 0.300" in md


def test_the_report_puts_the_base_model_at_iteration_0():
    rows = [{"iteration": k, "reward_mean": 0.1 * k} for k in range(1, 5)]
    rows[0].update(
        eval_base_pass_at_1_greedy=0.15,
        eval_base_pass_at_1=0.05,
        eval_base_pass_at_k=0.2,
        eval_base_k=4,
    )
    rows[3].update(eval_pass_at_1_greedy=0.6, eval_pass_at_1=0.5, eval_pass_at_k=0.7, eval_k=4)
    assert [p["iteration"] for p in eval_points(rows)] == [0, 4]
    assert eval_points(rows)[0]["eval_pass_at_1_greedy"] == 0.15
    md = summary_markdown("r", "/x", rows, [4], {}, {0: 4})
    assert "Evaluation of the base model: pass@1 greedy 0.150" in md
    assert "Evaluation at iteration 4: pass@1 greedy 0.600" in md
    assert row_fields(
        {
            "evaluated": True,
            "pass_at_1_greedy": 0.15,
            "pass_at_1": 0.05,
            "pass_at_k": 0.2,
            "n_samples": 4,
        },
        prefix="eval_base",
    ) == {
        "eval_base_pass_at_1_greedy": 0.15,
        "eval_base_pass_at_1": 0.05,
        "eval_base_pass_at_k": 0.2,
        "eval_base_k": 4,
    }
