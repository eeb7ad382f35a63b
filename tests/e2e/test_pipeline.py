"""One-step off-policy pipelining (``rollout.max_staleness: 1``): rollout[k+1]
runs beside train[k]. It learns; which version generates which batch is fixed by
the config, so a run that fails at every step, or whose flow process is
SIGKILLed while rollout[k+1] and train[k] both run, ends byte-identical to an
uninterrupted run."""

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


def pipelined(root: Path, name: str, faults: list[dict] | None = None) -> dict:
    return {**overrides(root, name, faults), "rollout.max_staleness": 1}


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


def test_sigkill_while_rollout_and_train_overlap_resumes_byte_identical(
    ray_cluster, prefect_api, pipelined_reference, tmp_path
):
    """rollout[k=4] runs beside train[3]: the flow process dies there; a rerun finishes."""
    from engines.group import EngineGroup

    over = pipelined(
        tmp_path, "pipe-sigkill", [{"step": "rollout", "iteration": 4, "kind": "sigkill"}]
    )
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
    assert final_weights(store) == pipelined_reference
    assert_records_complete(store)
    cfg = load_config(BASE, over)
    EngineGroup(cfg.run.name, cfg.engines, namespace=cfg.ray.namespace).shutdown()
