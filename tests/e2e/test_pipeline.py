"""Off-policy pipelining (``rollout.max_staleness: N``): rollout[k+N] runs beside
train[k]. It learns; which version generates which batch is fixed by the config,
so a run that fails at every step, or whose flow process is SIGKILLed while a
batch made ahead and train[k] both run, ends byte-identical to an uninterrupted
run. Staleness 1 runs the whole matrix here; staleness 2 with partial rollouts
(``rollout.partial``) runs its version split, a replayed step and a SIGKILL beside
training in CI, and its whole matrix (and staleness 1's SIGKILL beside training, and
staleness 4's SIGKILL at every step) when ``PREFECT_RL_FULL_MATRIX=1``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flows.config import load_config
from flows.driver import run_plain
from tests.e2e.fault_matrix import (
    BASE,
    ITERATIONS,
    KILL_PLAN,
    PLAN,
    assert_records_complete,
    final_weights,
    overrides,
)
from tests.e2e.services import rl_run_args, run_to_exit

pytestmark = pytest.mark.slow


PARTIAL = {"rollout.max_staleness": 2, "rollout.partial": True}
STALE4 = {"rollout.max_staleness": 4}
# Partial rollouts add a step: its faults hit heads and continuations of batches made ahead
# (batch j > 2 is split: head on v(j-3) in iteration j-2, the rest on v(j-2) in j-1).
PARTIAL_PLAN = {**PLAN, "rollout": 5, "rollout_head": 4}
# SIGKILLs hit batch 6's continuation, beside train[5], where no other step has a fault:
# batch 5's, beside train[4], can meet save_background[4] on the tiny model, and one
# SIGKILL would then end both.
PARTIAL_SIGKILL_PLAN = {**PARTIAL_PLAN, "rollout": 6}
PARTIAL_KILL_PLAN = {**KILL_PLAN, "rollout": 6, "rollout_head": 3}
FULL_MATRIX = pytest.mark.skipif(
    os.environ.get("PREFECT_RL_FULL_MATRIX") != "1",
    reason="the whole matrix at staleness 2 runs only with PREFECT_RL_FULL_MATRIX=1",
)


def pipelined(root: Path, name: str, faults: list[dict] | None = None, mode: dict | None = None):
    return {**overrides(root, name, faults), "rollout.max_staleness": 1, **(mode or {})}


def store_of(over: dict):
    from storage.run_store import RunStore

    return RunStore(load_config(BASE, over).storage, over["run.name"])


@pytest.fixture(scope="module")
def pipelined_reference(ray_cluster, tmp_path_factory) -> dict[str, str]:
    over = pipelined(tmp_path_factory.mktemp("pipe-ref"), "pipe-ref")
    ctx, _, _ = run_plain(load_config(BASE, over), quiet=True)
    store = ctx.store
    # Batch k came from v(k-2) (v0 for the first two): the config decides, not timing.
    for k in range(1, ITERATIONS + 1):
        versions = {s["weight_version"] for s in store.read_rollouts(k)["samples"]}
        assert versions == {max(k - 2, 0)}, (k, versions)
    return final_weights(store)


@pytest.fixture(scope="module")
def partial_reference(ray_cluster, tmp_path_factory) -> dict[str, str]:
    """Staleness 2 with partial rollouts, uninterrupted. Batch j > 2 carries two versions,
    v(j-3) on its head and v(j-2) on the rest; a rollout step run again from the persisted
    head (its batch deleted) rebuilds the batch byte for byte."""
    from tasks import runner, steps

    over = pipelined(tmp_path_factory.mktemp("partial-ref"), "partial-ref", mode=PARTIAL)
    ctx, _, _ = run_plain(load_config(BASE, over), quiet=True, keep_actors=True)
    store = ctx.store
    try:
        for k in range(1, ITERATIONS + 1):
            samples = store.read_rollouts(k)["samples"]
            versions = {
                v for s in samples for v in s.get("token_versions") or [s["weight_version"]]
            }
            assert versions == ({0} if k <= 2 else {k - 3, k - 2}), (k, versions)
            assert {s["weight_version"] for s in samples} == {max(k - 3, 0)}
        # The metrics row names the newest weights the batch came from: its reward
        # measures them (the UI's table shows it; bench.pipeline reads it).
        rows = store.read_metrics()
        assert [r["rollout_version"] for r in rows] == [
            max(k - 2, 0) for k in range(1, ITERATIONS + 1)
        ]
        before = store.fs.cat_file(store.rollouts_url(5))
        store.fs.rm(store.rollouts_url(5))
        store.fs.rm(f"{store.url}/ledger/iter_000005/rollout.json")
        again = runner.run(ctx, steps.ROLLOUT, 5)  # engines back on v3, the head continued
        assert again["versions"] == [2, 3] and not again["cached"]
        assert store.fs.cat_file(store.rollouts_url(5)) == before
    finally:
        ctx.trainer().shutdown()
        ctx.engines().shutdown()
    return final_weights(store)


@pytest.fixture(scope="module")
def stale4_reference(ray_cluster, tmp_path_factory) -> dict[str, str]:
    """Staleness 4, uninterrupted: batch k from v(k-5) (v0 for the first five)."""
    over = pipelined(tmp_path_factory.mktemp("stale4-ref"), "stale4-ref", mode=STALE4)
    ctx, _, _ = run_plain(load_config(BASE, over), quiet=True)
    for k in range(1, ITERATIONS + 1):
        versions = {s["weight_version"] for s in ctx.store.read_rollouts(k)["samples"]}
        assert versions == {max(k - 5, 0)}, (k, versions)
    rows = ctx.store.read_metrics()
    assert [r["rollout_version"] for r in rows] == [max(k - 5, 0) for k in range(1, ITERATIONS + 1)]
    return final_weights(ctx.store)


def test_partial_rollouts_carry_two_versions_and_replay_identically(partial_reference):
    assert partial_reference  # the checks are the fixture's: every later test relies on them


def test_off_policy_run_learns(ray_cluster, tmp_path):
    over = {"storage.root": str(tmp_path), "run.name": "learn-async", "rollout.max_staleness": 1}
    ctx, rows, _ = run_plain(load_config("configs/tiny-cpu.yaml", over), quiet=True)
    rewards = [r["reward_mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= 2 * first, f"reward did not double: first 5 {first:.3f}, last 5 {last:.3f}"
    assert ctx.store.serving_versions() == {0: 20}


def test_pipelined_run_heals_every_step_byte_identical(
    ray_cluster, prefect_api, pipelined_reference, tmp_path
):
    """Every step once by an exception and once by its killed actor, in one
    pipelined flow run; the rollout faults hit batches made ahead, beside training."""
    from flows.rl_training import rl_training

    faults = [
        {"step": s, "iteration": k, "kind": kind}
        for kind, points in {"exception": PLAN, "kill_actor": KILL_PLAN}.items()
        for s, k in points.items()
    ]
    over = pipelined(tmp_path, "pipe-faults", faults)
    state = rl_training(config_path=BASE, overrides=over, return_state=True)
    assert state.is_completed(), state
    store = store_of(over)
    fired = sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(f"{store.url}/faults"))
    assert fired == sorted(f"{f['step']}-{f['iteration']:06d}-{f['kind']}" for f in faults)
    assert final_weights(store) == pipelined_reference
    assert_records_complete(store)


@pytest.mark.parametrize(
    ("mode", "fault", "reference"),
    [
        # CI runs one of the two: staleness 2 with partial rollouts goes through every
        # part staleness 1 does, and the split batches too
        pytest.param(
            {}, {"step": "rollout", "iteration": 4}, "pipelined_reference", marks=FULL_MATRIX
        ),
        # the head of batch 5 runs beside train[3] on v2
        (PARTIAL, {"step": "rollout_head", "iteration": 5}, "partial_reference"),
    ],
    ids=["staleness1", "staleness2-partial"],
)
def test_sigkill_while_rollout_and_train_overlap_resumes_byte_identical(
    ray_cluster, prefect_api, request, tmp_path, mode, fault, reference
):
    """A batch made ahead runs beside train[3]: the flow process dies there; a rerun finishes."""
    from engines.group import EngineGroup

    expected = request.getfixturevalue(reference)
    name = "pipe-sigkill" if not mode else "partial-sigkill"
    over = pipelined(tmp_path, name, [{**fault, "kind": "sigkill"}], mode)
    over["ray.address"] = ray_cluster.get_runtime_context().gcs_address
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    codes = []
    for _ in range(2):
        code, err, _ = run_to_exit(rl_run_args(BASE, over), env)
        codes.append(code)
        assert code in (0, -9), err[-3000:]
    assert codes == [-9, 0], codes
    store = store_of(over)
    # Killed beside train[3]: iteration 3 was not committed when the process died.
    assert final_weights(store) == expected
    assert_records_complete(store)
    cfg = load_config(BASE, over)
    EngineGroup(cfg.run.name, cfg.engines, namespace=cfg.ray.namespace).shutdown()


@FULL_MATRIX
def test_partial_run_heals_every_step_byte_identical(
    ray_cluster, prefect_api, partial_reference, tmp_path
):
    """Staleness 2, partial: every step (heads and continuations too) once by an exception
    and once by its killed actor, in one flow run."""
    from flows.rl_training import rl_training

    faults = [
        {"step": s, "iteration": k, "kind": kind}
        for kind, points in {"exception": PARTIAL_PLAN, "kill_actor": PARTIAL_KILL_PLAN}.items()
        for s, k in points.items()
    ]
    over = pipelined(tmp_path, "partial-faults", faults, PARTIAL)
    state = rl_training(config_path=BASE, overrides=over, return_state=True)
    assert state.is_completed(), state
    store = store_of(over)
    fired = sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(f"{store.url}/faults"))
    assert fired == sorted(f"{f['step']}-{f['iteration']:06d}-{f['kind']}" for f in faults)
    assert final_weights(store) == partial_reference
    assert_records_complete(store)


@FULL_MATRIX
@pytest.mark.parametrize(
    ("mode", "plan", "reference"),
    [(PARTIAL, PARTIAL_SIGKILL_PLAN, "partial_reference"), (STALE4, PLAN, "stale4_reference")],
    ids=["staleness2-partial", "staleness4"],
)
def test_run_made_ahead_resumes_byte_identical_after_a_sigkill_at_every_step(
    ray_cluster, prefect_api, request, tmp_path, mode, plan, reference
):
    """Staleness 2 with partial rollouts, and staleness 4 (four batches made ahead): each
    step's SIGKILL of the flow process, then a rerun."""
    from engines.group import EngineGroup

    expected = request.getfixturevalue(reference)
    faults = [{"step": s, "iteration": k, "kind": "sigkill"} for s, k in plan.items()]
    over = pipelined(tmp_path, "ahead-sigkill-all", faults, mode)
    over["ray.address"] = ray_cluster.get_runtime_context().gcs_address
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    codes = []
    cfg = load_config(BASE, over)
    try:
        for _ in range(len(faults) + 1):
            code, err, _ = run_to_exit(rl_run_args(BASE, over), env)
            codes.append(code)
            assert code in (0, -9), err[-3000:]
            if code == 0:
                break
        assert codes == [-9] * len(faults) + [0], codes  # each fault its own SIGKILL
        store = store_of(over)
        assert final_weights(store) == expected
        assert_records_complete(store)
    finally:  # the next case runs under the same run name
        EngineGroup(cfg.run.name, cfg.engines, namespace=cfg.ray.namespace).shutdown()
