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
from tasks.metrics_row import BASE_EVAL


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


@pytest.mark.parametrize(
    ("staleness", "sources"),
    [(0, [0, 1, 2, 3, 4, 5]), (1, [0, 0, 1, 2, 3, 4]), (2, [0, 0, 0, 1, 2, 3]), (4, [0] * 5 + [1])],
)
def test_which_version_generates_which_batch_is_fixed_by_the_config(tmp_path, staleness, sources):
    ctx = make_ctx(tmp_path, **{"rollout.max_staleness": staleness})
    assert [steps.rollout_source(ctx, k) for k in range(1, 7)] == sources
    assert [steps.continue_source(ctx, k) for k in range(1, 7)] == [None] * 6


def made(ctx, *batches: int) -> None:
    """Batches the iterations before made: their rollout records are in the ledger."""
    for j in batches:
        ctx.store.write_record(j, "rollout", {"result": {}})


def test_staleness_n_makes_batch_k_plus_n_beside_training_and_no_other(tmp_path):
    ctx = make_ctx(tmp_path, **{"rollout.max_staleness": 3, "run.iterations": 8})
    first = waits(plan.iteration_plan(ctx, 1))  # batches 1..4, all on v0, one after another
    assert [i for i in first if i.startswith("rollout")] == [f"rollout@{j}" for j in (1, 2, 3, 4)]
    assert first["rollout@4"] == ("rollout@3",) and first["train@1"] == ("rollout@1",)
    assert first["reload-e0@1"] == ("publish@1", "rollout@4")
    made(ctx, 1, 2, 3, 4)
    nodes = waits(plan.iteration_plan(ctx, 2))
    # 3 and 4 were made by iteration 1's plan: not planned (nor regenerated) again
    assert [i for i in nodes if i.startswith("rollout")] == ["rollout@2", "rollout@5"]
    assert nodes["rollout@5"] == ("rollout@2",) and nodes["reload-e1@2"] == (
        "publish@2",
        "rollout@5",
    )
    # Near the end no batch past run.iterations; a missing batch (iterations grew) is made in order.
    assert [i for i in waits(plan.iteration_plan(ctx, 7)) if i.startswith("rollout")] == [
        "rollout@7",
        "rollout@8",
    ]


@pytest.mark.parametrize(("staleness", "first_split"), [(1, 2), (2, 3), (4, 5)])
def test_partial_batches_switch_version_at_a_place_fixed_by_the_config(
    tmp_path, staleness, first_split
):
    over = {"rollout.max_staleness": staleness, "rollout.partial": True}
    ctx = make_ctx(tmp_path, **over)
    for k in range(1, 9):
        later = None if k < first_split else k - staleness
        assert steps.continue_source(ctx, k) == later
        assert steps.rollout_source(ctx, k) == max(k - 1 - staleness, 0)


def test_partial_rollout_continues_beside_the_next_training(tmp_path):
    over = {"rollout.max_staleness": 2, "rollout.partial": True, "run.iterations": 6}
    ctx = make_ctx(tmp_path, **over)
    made(ctx, 1, 2, 3)  # batch 4's head was made beside train[2]; its rest is iteration 3's
    nodes = waits(plan.iteration_plan(ctx, 3))
    assert nodes["rollout_head@4"] == ("rollout@3",)  # persisted: the step reuses it
    assert nodes["rollout@4"] == ("rollout_head@4",)  # the rest on v2, beside train[3]
    assert nodes["rollout_head@5"] == ("rollout@4",)  # then batch 5's head, on v2 too
    assert nodes["train@3"] == ("rollout@3",)  # after neither: they overlap
    assert nodes["reload-e0@3"] == ("publish@3", "rollout_head@5")  # switch between batches
    assert nodes["iteration@3"] == ("verify-e0@3", "verify-e1@3")  # waits for no rollout
    assert "rollout@5" not in nodes  # batch 5's rest is iteration 4's, on v3
    made(ctx, 4)
    after = waits(plan.iteration_plan(ctx, 4))
    assert after["rollout@5"] == ("rollout_head@5",) and after["rollout_head@6"] == ("rollout@5",)
    # Staleness 1: the rest of batch k is what train[k] waits for.
    one = make_ctx(tmp_path / "one", **{**over, "rollout.max_staleness": 1})
    made(one, 1, 2)
    nodes = waits(plan.iteration_plan(one, 3))
    assert nodes["rollout@3"] == ("rollout_head@3",) and nodes["train@3"] == ("rollout@3",)
    assert nodes["rollout_head@4"] == ("rollout@3",)


@pytest.mark.parametrize(
    ("sets", "named"),
    [
        ({"rollout.max_staleness": 17}, "rollout.max_staleness 17 is above 16"),
        ({"rollout.partial": True}, "set rollout.max_staleness >= 1"),
        (
            {"rollout.partial": True, "rollout.max_staleness": 1, "rollout.partial_chunk": 4},
            "below max_new_tokens",
        ),
        ({"rollout.partial_chunk": 2}, "rollout.partial is false"),
        (
            {
                "rollout.partial": True,
                "rollout.max_staleness": 1,
                "rollout.environment": "calculator",
            },
            "single-turn",
        ),
    ],
)
def test_staleness_and_partial_settings_that_cannot_work_are_refused(tmp_path, sets, named):
    with pytest.raises(ValueError, match=named):
        make_ctx(tmp_path, **sets)


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


def test_the_base_model_is_evaluated_before_the_first_batch_and_reaches_row_1(tmp_path):
    """eval.before_training: evaluate[0] runs first in iteration 1's plan (engines serve
    v0), rollout[1] waits for it, and finish[1] gets it as the base evaluation."""
    ctx = make_ctx(tmp_path, **{"eval.interval": 2, "run.iterations": 4})
    first = waits(plan.iteration_plan(ctx, 1))
    assert first["evaluate@0"] == () and first["rollout@1"] == ("evaluate@0",)
    assert "evaluate@0" not in waits(plan.iteration_plan(ctx, 2))
    finish = next(n for n in plan.iteration_plan(ctx, 1) if n.step is steps.FINISH)
    done = {"evaluate@0": {"evaluated": True}, "rollout@1": {"r": 1}}
    assert plan.node_inputs(finish, done)["results"] == {
        BASE_EVAL: {"evaluated": True},
        "rollout": {"r": 1},
    }
    off = make_ctx(tmp_path, **{"eval.interval": 2, "eval.before_training": False})
    assert "evaluate@0" not in waits(plan.iteration_plan(off, 1))
