"""A long flow run keeps at most one iteration's bookkeeping in the flow process
(``bench/soak.py`` measures the memory; these check the structures)."""

from __future__ import annotations

import threading

import pytest
from prefect import flow, task
from prefect.task_runners import ThreadPoolTaskRunner

from flows.artifacts import Reporter
from flows.iteration import forget_finished_runs

TASK_RUNS = 4  # per "iteration"


@task
def step(k: int, i: int) -> dict:
    # A result with components Prefect links one by one (a list, a string, a float).
    return {"k": k, "i": i, "phases": [0.5, 1.5], "example": f"sample {k}-{i}", "s": 0.25}


@flow(task_runner=ThreadPoolTaskRunner(max_workers=4))
def iterations(n: int) -> list[dict[str, int]]:
    dropped = []
    for k in range(n):
        futures = [step.submit(k, i) for i in range(TASK_RUNS)]
        [f.result() for f in futures]
        dropped.append(forget_finished_runs())
    return dropped


def test_each_iteration_leaves_no_task_run_bookkeeping_behind(prefect_api):
    dropped = iterations(3)
    # Every iteration drops only its own task runs' entries: the same count each time
    # (growing counts would mean earlier iterations' entries were still kept)...
    assert dropped[0] == dropped[1] == dropped[2]
    # ...and Prefect still keeps them where the flow drops them: a Prefect that
    # renamed one of these would make the flow's cleanup a silent no-op.
    assert dropped[0]["cancel_events"] == TASK_RUNS
    assert dropped[0]["task_run_assets"] == TASK_RUNS
    assert dropped[0]["run_results"] >= TASK_RUNS


def test_forget_outside_a_flow_run_does_nothing():
    assert forget_finished_runs() == {}


def test_reporter_keeps_only_unchecked_calls_and_raises_the_first_failure():
    def fail(what: str) -> None:
        raise RuntimeError(what)

    report, reached = Reporter(), threading.Event()
    report.submit(fail, "first")
    report.submit(fail, "second")
    for _ in range(100):
        report.submit(lambda: None)
    report.submit(reached.set)
    assert reached.wait(timeout=60)  # one worker, in order: every call before it has ended
    report.submit(lambda: None)
    assert report.pending() <= 2  # the last two at most, not the 104 submitted
    with pytest.raises(RuntimeError, match="first"):
        report.close()


def test_a_local_cluster_caps_the_gcs_task_history_unless_the_user_set_it(monkeypatch):
    from tasks.cluster import LOCAL_TASK_EVENTS_CAP, local_system_config

    monkeypatch.delenv("RAY_task_events_max_num_task_in_gcs", raising=False)
    assert local_system_config() == {"task_events_max_num_task_in_gcs": LOCAL_TASK_EVENTS_CAP}
    # Ray's own variable, exported by the user, is read by the GCS as it starts.
    monkeypatch.setenv("RAY_task_events_max_num_task_in_gcs", "500")
    assert local_system_config() == {}
