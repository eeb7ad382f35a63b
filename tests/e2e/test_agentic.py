"""Multi-turn tool use end to end (configs/tiny-tool.yaml): the warm-started tiny
model learns to call the calculator and reward goes up, and a run whose engine
dies mid-rollout and whose train step crashes (its rewards scored by Ray
tasks), resumed, ends byte-identical to an uninterrupted run scored in process
(the fault matrix's helpers,
tests/e2e/fault_matrix.py)."""

from __future__ import annotations

import pytest

from flows.config import load_config
from flows.driver import run_plain
from rollout.agent import tool_use
from rollout.types import RolloutBatch
from tests.e2e.fault_matrix import assert_records_complete, final_weights, overrides

pytestmark = pytest.mark.slow

BASE = "configs/tiny-tool.yaml"
# The crash row's length: the engine dies in rollout[2], the run crashes in train[3] and
# resumes from checkpoint 2; one iteration after the replayed one shows it continues
# as the reference does (the fault matrix's six add multi-turn rollouts, nothing else).
ITERATIONS = 4


def test_the_model_learns_to_call_the_tool_and_reward_goes_up(ray_cluster, tmp_path):
    # Evaluated at iterations 10 and 20: multi-turn episodes through the engines' HTTP API.
    evaluate = {
        "eval.interval": 10,
        "eval.size": 8,
        "eval.n_samples": 2,
        "eval.pass_threshold": 0.5,
    }
    cfg = load_config(BASE, {"storage.root": str(tmp_path), "run.name": "tool-learn", **evaluate})
    ctx, rows, _ = run_plain(cfg, quiet=True)
    assert [r["iteration"] for r in rows if r.get("eval_pass_at_1") is not None] == [10, 20]
    rewards = [r["reward_mean"] for r in rows]
    calls = [r["tool_call_rate"] for r in rows]
    print("tool_call_rate per iteration:", [round(c, 3) for c in calls])
    print("reward_mean per iteration:", [round(r, 3) for r in rewards])
    assert len(rewards) == cfg.run.iterations == 20

    def first_last(xs: list[float]) -> tuple[float, float]:
        return sum(xs[:5]) / 5, sum(xs[-5:]) / 5

    first, last = first_last(rewards)
    assert first > 0
    assert last >= 2 * first, f"reward did not double: first 5 {first:.3f}, last 5 {last:.3f}"
    # The reward is the exact answer only (no credit for calling): it rises because the
    # policy learns to call the calculator, which the warm-started base rarely did.
    c_first, c_last = first_last(calls)
    assert c_last >= max(2 * c_first, 0.2), f"calls: first 5 {c_first:.3f}, last 5 {c_last:.3f}"
    batch = RolloutBatch.from_json(ctx.store.read_rollouts(20))
    # every sample is an episode: its loss mask covers its model turns only
    for s in batch.samples:
        model = sum(len(t.ids) for t in s.turns if t.role == "model")
        assert sum(s.loss_mask) == model and len(s.loss_mask) == len(s.response_ids)
    # Each metrics row shows how its batch used the tool, as the persisted batch has it.
    tools = ctx.store.read_record(20, "rollout")["result"]["tools"]
    assert tools == tool_use(batch.samples, "calculator")
    assert rows[-1]["tool_call_rate"] == tools["call_rate"]
    # most full-score answers of the last batch followed a call
    assert tools["correct_after_call"] > tools["correct"] / 2, tools


def test_a_dead_engine_and_a_crash_resume_byte_identical(ray_cluster, tmp_path):
    def config(name: str, faults: list[dict], **extra):
        over = overrides(tmp_path / name, name, faults)
        return load_config(
            BASE, {**over, "run.iterations": ITERATIONS, "run.save_interval": 2, **extra}
        )

    ref_ctx, _, _ = run_plain(config("ref", []), quiet=True)
    faults = [
        {"step": "rollout", "iteration": 2, "kind": "kill_actor"},  # the engine dies in the step
        {"step": "train", "iteration": 3, "kind": "exception"},  # the run crashes
    ]
    # ... and its rewards are scored by 2 Ray tasks: the same rewards as in process
    cfg = config("faulted", faults, **{"rollout.reward_workers": 2})
    with pytest.raises(Exception, match="injected"):
        run_plain(cfg, quiet=True)
    ctx, rows, _ = run_plain(cfg, quiet=True)  # the rerun resumes at iteration 3
    assert [r["iteration"] for r in rows] == list(range(3, ITERATIONS + 1))
    assert final_weights(ctx.store, ITERATIONS) == final_weights(ref_ctx.store, ITERATIONS)
    assert_records_complete(ctx.store, ITERATIONS)
    # the killed engine was restarted in the rollout step, which recorded the retry
    record = ctx.store.read_record(2, "rollout-failures")
    assert [(r["engine"], r["kind"]) for r in record["retries"]][:1] == [(0, "infra")]
    assert ctx.store.read_record(2, "rollout")["result"]["failures"]["retries"] >= 1
    assert ctx.store.read_rollouts(2) == ref_ctx.store.read_rollouts(2) | {
        "failures": ctx.store.read_rollouts(2)["failures"]
    }
