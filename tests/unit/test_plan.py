"""The iteration plan (``tasks.plan``): its shape for each ``rollout.max_staleness``,
which version generates which batch, and ``walk``: dependencies honoured,
independent nodes overlapping, nothing started after a failure."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from flows.config import load_config
from tasks import plan, steps
from tasks.context import RunContext


def make_ctx(tmp_path, **over) -> RunContext:
    over = {"run.name": "plan", "storage.root": str(tmp_path), "engines.num_engines": 2, **over}
    return RunContext(cfg=load_config("configs/tiny-cpu.yaml", over), base_model_path=str(tmp_path))


def waits(nodes) -> dict[str, tuple[str, ...]]:
    return {n.id: n.after for n in nodes}


def test_on_policy_plan_is_the_chain_with_engines_side_by_side(tmp_path):
    nodes = plan.iteration_plan(make_ctx(tmp_path), 3)
    assert waits(nodes) == {
        "rollout@3": (),
        "train@3": ("rollout@3",),
        "save@3": ("train@3",),
        "publish@3": ("save@3",),
        "reload-e0@3": ("publish@3",),
        "verify-e0@3": ("reload-e0@3",),
        "reload-e1@3": ("publish@3",),
        "verify-e1@3": ("reload-e1@3",),
        "iteration@3": ("verify-e0@3", "verify-e1@3"),
    }


def test_one_step_off_policy_generates_the_next_batch_beside_training(tmp_path):
    ctx = make_ctx(tmp_path, **{"rollout.max_staleness": 1, "run.iterations": 4})
    nodes = waits(plan.iteration_plan(ctx, 3))
    assert nodes["rollout@4"] == ("rollout@3",)  # not after train@3: they overlap
    assert nodes["reload-e0@3"] == ("publish@3", "rollout@4")  # engines switch between batches
    # The last iteration makes no batch past the run's end.
    assert "rollout@5" not in waits(plan.iteration_plan(ctx, 4))


@pytest.mark.parametrize(("staleness", "sources"), [(0, [0, 1, 2, 3]), (1, [0, 0, 1, 2])])
def test_which_version_generates_which_batch_is_fixed_by_the_config(tmp_path, staleness, sources):
    ctx = make_ctx(tmp_path, **{"rollout.max_staleness": staleness})
    assert [steps.rollout_source(ctx, k) for k in (1, 2, 3, 4)] == sources


def test_pipelining_is_refused_on_colocated_devices(tmp_path):
    with pytest.raises(ValueError, match="placement.colocate"):
        make_ctx(tmp_path, **{"rollout.max_staleness": 1, "placement.colocate": True})


def _run(nodes, work):
    """Walk ``nodes`` on threads; ``work(node)`` is each node's body. Returns start order."""
    started, lock = [], threading.Lock()

    def body(node):
        with lock:
            started.append(node.id)
        return work(node)

    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        out = plan.walk(nodes, lambda n, done: pool.submit(body, n))
    return out, started


def test_walk_starts_a_node_only_after_what_it_waits_for(tmp_path):
    ctx = make_ctx(tmp_path, **{"rollout.max_staleness": 1, "run.iterations": 5})
    nodes = plan.iteration_plan(ctx, 2)
    finished: list[str] = []

    def work(node):
        assert all(a in finished for a in node.after), node.id
        time.sleep(0.01)
        finished.append(node.id)
        return node.id

    out, _ = _run(nodes, work)
    assert out == {n.id: n.id for n in nodes}


def test_walk_overlaps_independent_nodes(tmp_path):
    ctx = make_ctx(tmp_path, **{"rollout.max_staleness": 1, "run.iterations": 5})
    nodes = plan.iteration_plan(ctx, 2)
    both = threading.Barrier(2, timeout=10)

    def work(node):
        if node.id in ("train@2", "rollout@3"):
            both.wait()  # deadlocks (BrokenBarrierError) unless the two run at once
        return None

    _run(nodes, work)


def test_after_a_failure_nothing_new_starts_and_the_error_is_raised(tmp_path):
    nodes = plan.iteration_plan(make_ctx(tmp_path), 1)

    def work(node):
        if node.id == "save@1":
            raise RuntimeError("disk full")
        return None

    started: list[str] = []
    with ThreadPoolExecutor(max_workers=4) as pool, pytest.raises(RuntimeError, match="disk full"):
        plan.walk(nodes, lambda n, done: started.append(n.id) or pool.submit(work, n))
    assert started == ["rollout@1", "train@1", "save@1"]


def test_finish_gets_its_iterations_results_by_ledger_key(tmp_path):
    ctx = make_ctx(tmp_path, **{"rollout.max_staleness": 1, "run.iterations": 5})
    nodes = plan.iteration_plan(ctx, 2)
    seen = {}

    def work(node):
        if node.step is steps.FINISH:
            seen.update(node.inputs)
        return {"id": node.id}

    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:

        def start(n, done):
            n = type("N", (), {"step": n.step, "id": n.id, "inputs": plan.node_inputs(n, done)})
            return pool.submit(work, n)

        plan.walk(nodes, start)
    results = seen["results"]
    assert results["train"] == {"id": "train@2"} and results["reload-e1"] == {"id": "reload-e1@2"}
    assert "rollout" in results and results["rollout"] == {"id": "rollout@2"}  # not rollout@3


def test_a_plan_with_a_cycle_or_a_missing_node_is_refused(tmp_path):
    a = plan.Node(steps.TRAIN, 1, after=("save@1",))
    b = plan.Node(steps.SAVE, 1, after=("train@1",))
    with pytest.raises(ValueError, match="wait for each other"):
        plan.walk([a, b], lambda n, done: None)
    with pytest.raises(ValueError, match="not in the plan"):
        plan.walk([a], lambda n, done: None)
