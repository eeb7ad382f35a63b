"""Each algorithm beyond GRPO (``bench.algorithms.ALGORITHMS``: GSPO, DAPO with
dynamic sampling, REINFORCE++, PPO with a critic), once each:

- it learns: on the default task with a fixed seed, the mean reward of the
  last 5 of 20 iterations is at least twice that of the first 5 (GRPO's own
  row is ``test_learning.py``);
- a crash and a resume end byte-identical, for the algorithms that keep state
  of their own across iterations: PPO (the critic, with its own checkpoints)
  and DAPO (dynamic sampling draws more groups per rollout). The fault matrix's
  small run (``fault_matrix.overrides``, evaluated every 3 iterations) crashes:
  a train rank killed at train[4] (PPO: the critic's, restored from its
  checkpoint 2 and replayed over 3), an exception at rollout[5] and, in DAPO's
  row, one at evaluate[3]; the driver has no retries, so each crash ends the
  run and a new one resumes it. Its final weights and eval scores equal an
  uninterrupted run's. GSPO and REINFORCE++ change only the loss and the
  advantages of one batch, functions of state that GRPO's own fault matrix
  (``test_faults.py``) already recovers; their crash rows would repeat it.
"""

from __future__ import annotations

import pytest
import ray

from bench.algorithms import ALGORITHMS, BASE, first_last, run
from flows.config import load_config
from flows.driver import run_plain
from rollout.types import RolloutBatch
from storage.run_store import RunStore
from tasks.faults import InjectedFault
from tests.e2e.fault_matrix import assert_records_complete, final_weights, overrides
from training.critic_store import CriticStore

pytestmark = pytest.mark.slow

LEARNERS = ["gspo", "dapo", "reinforce_pp", "ppo"]
STATEFUL = ["dapo", "ppo"]  # state beyond GRPO's: dynamic sampling, the critic
CRASHES = [
    {"step": "train", "iteration": 4, "kind": "kill_actor"},
    {"step": "rollout", "iteration": 5, "kind": "exception"},
]
# One row also crashes in the evaluate step (each crash costs a restart).
EVAL_CRASH = {"dapo": [{"step": "evaluate", "iteration": 3, "kind": "exception"}]}
# Evaluated at 3 and 6 in both runs: the scores of a resumed run are the same too.
# A low pass threshold, so a tiny policy gets scores above zero to compare.
EVAL = {"eval.interval": 3, "eval.size": 8, "eval.n_samples": 4, "eval.pass_threshold": 0.2}


@pytest.mark.parametrize("name", LEARNERS)
def test_each_algorithm_learns_on_the_default_task(ray_cluster, tmp_path, name):
    rows, _ = run(name, str(tmp_path))
    rewards = [r["reward_mean"] for r in rows]
    assert len(rewards) == 20
    first, last = first_last(rewards)
    assert first > 0, "a random policy scores above zero on this task"
    assert last >= 2 * first, f"{name}: reward did not double: {first:.3f} -> {last:.3f}"
    cfg = load_config(BASE, {"storage.root": str(tmp_path), "run.name": f"algo-{name}"})
    store = RunStore(cfg.storage, cfg.run.name)
    if name == "dapo":  # dynamic sampling replaced groups of equal rewards
        batch = RolloutBatch.from_json(store.read_rollouts(1))
        s = batch.sampling
        assert s.rounds > 1 and s.dropped_groups > 0
        # every prompt asked is accounted for: in the batch, dropped, or kept past it
        batch_size = cfg.rollout.batch_size
        assert s.prompts == batch_size - s.filled_uniform + s.dropped_groups + s.unused_groups
        # the metrics row (UI table, trackers) shows the reward of all that was generated
        # beside the kept batch's, and the rounds it took
        assert rows[0]["sampling_rounds"] == batch.sampling.rounds
        assert rows[0]["reward_mean_generated"] == batch.sampling.reward_mean_generated
        assert rows[0]["reward_mean_generated"] != rows[0]["reward_mean"]
    if name == "ppo":  # the critic trained beside the policy and was checkpointed
        assert "vf_loss" in store.read_record(20, "train")["result"]
        assert CriticStore(cfg.storage, cfg.run.name).committed_checkpoints() == [5, 10, 15, 20]


@pytest.mark.parametrize("name", STATEFUL)
def test_a_crashed_and_resumed_run_is_byte_identical(ray_cluster, tmp_path, name):
    algorithm = ALGORITHMS[name]
    ref = load_config(BASE, {**overrides(tmp_path, f"{name}-ref"), **algorithm, **EVAL})
    reference, _, _ = run_plain(ref, quiet=True)
    faults = EVAL_CRASH.get(name, []) + CRASHES
    over = {**overrides(tmp_path, f"{name}-crashed", faults), **algorithm, **EVAL}
    crashes = 0
    while True:
        try:
            ctx, _, _ = run_plain(load_config(BASE, over), quiet=True)
            break
        except Exception as e:  # noqa: BLE001 - an injected fault, or what a killed rank left
            assert isinstance(e, InjectedFault | ray.exceptions.RayError | ValueError), e
            crashes += 1
            assert crashes <= len(faults), "a fault fired twice"
    assert crashes == len(faults)
    assert final_weights(ctx.store) == final_weights(reference.store)
    assert_records_complete(ctx.store)
    evals = [
        {k: v for k, v in r.items() if k.startswith("eval_")} for r in ctx.store.read_metrics()
    ]
    assert evals == [
        {k: v for k, v in r.items() if k.startswith("eval_")}
        for r in reference.store.read_metrics()
    ]
    # Row 1: the base model's scores (eval.before_training); then every 3rd and the last.
    assert [bool(e) for e in evals] == [True, False, True, False, False, True]
    assert all(k.startswith("eval_base_") for k in evals[0])
    assert any(v for e in evals for k, v in e.items() if k != "eval_k")
    if name == "ppo":  # the critic's own checkpoints, beside the policy's
        critic = CriticStore(ctx.cfg.storage, ctx.run_name)
        assert critic.committed_checkpoints() == ctx.store.committed_checkpoints() == [2, 4, 6]
