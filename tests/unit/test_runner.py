"""The step runner (``tasks.runner``): ledger first, phases in order, fault
points, audit records, per-engine keys. Real storage (a local RunStore); the
steps are small declarations of their own, no actors."""

from __future__ import annotations

import pytest

from flows.config import load_config
from tasks import runner
from tasks.context import RunContext
from tasks.faults import InjectedFault
from tasks.phases import phase
from tasks.runner import Step


def make_ctx(tmp_path, faults=None) -> RunContext:
    over = {"run.name": "unit", "storage.root": str(tmp_path), "faults": faults or []}
    return RunContext(cfg=load_config("configs/tiny-cpu.yaml", over), base_model_path=str(tmp_path))


def test_a_committed_step_is_returned_from_the_ledger(tmp_path):
    ctx, calls = make_ctx(tmp_path), []
    step = Step("work", "do_work", lambda ctx, k, e: calls.append(k) or {"value": k})
    first = runner.run(ctx, step, 3)
    again = runner.run(ctx, step, 3)
    assert calls == [3]
    assert (first["value"], first["cached"], again["value"], again["cached"]) == (3, False, 3, True)
    assert ctx.store.read_record(3, "work")["result"] == {"value": 3}


def test_phases_run_in_order_and_warnings_are_committed(tmp_path, monkeypatch):
    ctx, order = make_ctx(tmp_path), []
    monkeypatch.setattr(
        runner, "maybe_fail", lambda ctx, point, k, kill: order.append(f"fault:{point}")
    )
    step = Step(
        "s",
        "s_task",
        lambda ctx, k, e: order.append("work") or {"ok": True},
        fault="s",
        ready=lambda ctx, k, e: order.append("ready") or ["restored from an older checkpoint"],
        skip=lambda ctx, k: order.append("skip") or None,
    )
    out = runner.run(ctx, step, 1)
    assert order == ["skip", "ready", "fault:s", "work"]
    assert out["warnings"] == ["restored from an older checkpoint"]


def test_skip_answers_without_ready_fault_or_work(tmp_path):
    ctx = make_ctx(tmp_path, faults=[{"step": "train", "iteration": 1}])
    boom = lambda *a: pytest.fail("must not run")  # noqa: E731
    step = Step("s", "s_task", boom, fault="train", ready=boom, skip=lambda ctx, k: {"due": False})
    assert runner.run(ctx, step, 1)["due"] is False


def test_the_declared_fault_point_fires_once_then_heals(tmp_path):
    ctx = make_ctx(tmp_path, faults=[{"step": "train", "iteration": 2}])
    step = Step("s", "s_task", lambda ctx, k, e: {"k": k}, fault="train")
    assert runner.run(ctx, step, 1)["k"] == 1  # no fault at k=1
    with pytest.raises(InjectedFault, match=r"train\[k=2\]"):
        runner.run(ctx, step, 2)
    assert ctx.store.read_record(2, "s") is None  # nothing committed by the failed attempt
    assert runner.run(ctx, step, 2)["k"] == 2


def test_per_engine_keys_and_audit_records(tmp_path):
    ctx, seen = make_ctx(tmp_path), []
    step = Step(
        "check",
        "check_task",
        lambda ctx, k, e: seen.append(e) or {"engine": e},
        per_engine=True,
        audit=True,
    )
    assert step.key(3) == "check-e3"
    with pytest.raises(ValueError, match="pass engine_id"):
        step.key()
    runner.run(ctx, step, 1, 3)
    runner.run(ctx, step, 1, 3)
    assert seen == [3, 3]  # an audit step runs every time
    assert ctx.store.read_record(1, "check-e3")["result"] == {"engine": 3}


def test_the_iteration_is_declared_once():
    from flows.step_tasks import TASKS
    from tasks import steps

    names = [s.name for s in steps.STEPS]
    assert names == [
        "rollout",
        "rollout_head",
        "train",
        "save",
        "publish",
        "reload",
        "verify",
        "evaluate",
    ]
    assert set(TASKS) == {*names, "iteration"}
    assert [s.name for s in steps.STEPS if s.per_engine] == ["reload", "verify"]
    assert [s.name for s in steps.STEPS if s.audit] == ["verify"]
    # every fault point of the e2e matrix is declared by exactly one step
    assert sorted(s.fault for s in steps.STEPS) == sorted(names)
    # every step declares the model its result is checked against before the commit
    assert all(s.result is not None for s in (*steps.STEPS, steps.FINISH))


def test_a_result_of_the_wrong_shape_is_refused_before_the_commit(tmp_path):
    from tasks.types import ReloadResult

    ctx = make_ctx(tmp_path)
    step = Step(
        "r", "r_task", lambda ctx, k, e: {"engine": 0, "version": "v1"}, result=ReloadResult
    )
    with pytest.raises(ValueError, match="reload_s"):
        runner.run(ctx, step, 1)
    assert ctx.store.read_record(1, "r") is None


def test_the_record_says_where_the_step_spent_its_seconds(tmp_path):
    """``phases``: ready and work by the runner, named parts by the work itself."""
    import time

    def work(ctx, k, e):
        with phase("upload"):
            time.sleep(0.05)
        with phase("upload"):  # a phase entered twice adds up
            time.sleep(0.05)
        return {"ok": True}

    ctx = make_ctx(tmp_path)
    step = Step("s", "s_task", work, ready=lambda ctx, k, e: time.sleep(0.02) or [])
    runner.run(ctx, step, 1)
    record = ctx.store.read_record(1, "s")
    phases = record["phases"]
    assert set(phases) == {"ready", "work", "upload"}
    assert phases["upload"] >= 0.1 and phases["ready"] >= 0.02
    assert phases["upload"] <= phases["work"] <= record["seconds"]
    with phase("upload"):  # outside a step: nothing to record, no error
        pass
