"""One RL iteration k as task runs of the ``rl-training`` flow run.

    weights v(k-1) on engines
            │
      rollout[k] ──► rollouts/iter_k        (engines generate; samples carry their version)
            │
       train[k]  ──► trainer state k         (ensure_state(k-1) first: restore + replay)
            │
       save[k]   ──► checkpoints/iter_k      (every save_interval and at the end)
            │
      publish[k] ──► weights/v{k}            (HF safetensors, manifest last = commit)
            │
   reload[k, e] for each engine e            (one task run per engine, retried alone)
            │
   verify[k, e] for each engine e            (engine e serves "k", else the task fails)
            │
      finish[k]  ──► metrics row + ledger/iter_k/iteration.json (the iteration's commit)

With ``rollout.max_staleness: N``, rollout[k+N] runs beside train[k] on v(k-1)
and reload[k] waits for it; with ``rollout.partial`` only its head does, and the
rest runs on v(k) first thing in iteration k+1, beside train[k+1] (``tasks.plan``
draws the shapes). The DAG is
``tasks.plan.iteration_plan``, written once; this module and the plain driver
(``flows/driver.py``) both hand it to ``tasks.plan.walk``, which starts a node
when what it waits for has succeeded, so a failed step leaves no task run
waiting behind it. Every step gets the same cross-cutting concerns from
``tasks.runner.run``: ledger first, timing, its colocation turn, its
fault-injection point, warnings, the commit. Each step's task is generated from
its declaration (``flows.step_tasks``); Prefect adds retries and the result
cache (``{run}/{k}/{step}``) through ``_opts``; verify alone is never cached. The step's deadline (``tasks.timeout_s``) is enforced where it waits.

Steps drive Ray actors; they run on the flow's thread pool in the flow process
(the Ray driver), not as Ray tasks: their work is on the actors already, and a
Ray task per step cost ~0.35 s of Prefect and Ray overhead each. An iteration
is not a subflow either: a Prefect 3.9 subflow costs ~0.3 s to create and
joins its heartbeat thread, which sleeps in 1 s steps, at its end. An
iteration is recognisable in the UI by its task-run names (``<run>:train[k=3]``;
a rollout made ahead is ``rollout[k=5]`` among iteration 3's task runs at staleness 2). Task
runs carry no per-iteration tag: Prefect treats every tag as a concurrency-limit
name and a new one cost ~2 s on this machine.

Shutdown: when healthy, ``rl_training`` ends the actors after the last
iteration. After a crash nothing needs cleaning by hand: a rerun finds the
first uncommitted step in the ledger and heals from storage.
"""

from __future__ import annotations

import hashlib
from typing import Any

from prefect.utilities.annotations import quote

from flows.step_tasks import TASKS
from storage.fs import is_local, s3_settings
from tasks import plan, steps
from tasks.context import RunContext


def run_iteration(ctx: RunContext, k: int) -> dict[str, Any]:
    """Run iteration k's plan as task runs of the current flow run; its results by
    node id (``train@3``, ``reload-e0@3``, ...) and the metrics row as ``row``."""

    def start(node: plan.Node, done: dict[str, Any]):
        task = _opts(ctx, node.step.name, audit=node.step.audit)
        per_engine = {"engine_id": node.engine_id} if node.step.per_engine else {}
        # quote(): Prefect would otherwise walk the whole RunContext (its config) and
        # the upstream results twice per task run looking for futures; they hold none.
        inputs = {name: quote(value) for name, value in plan.node_inputs(node, done).items()}
        return task.submit(quote(ctx), node.k, **per_engine, **inputs)

    results = plan.walk(plan.iteration_plan(ctx, k), start)
    forget_finished_runs()
    return {**results, "row": results[f"{steps.FINISH.key()}@{k}"]}


def forget_finished_runs() -> dict[str, int]:
    """Drop what Prefect 3.9 keeps of each finished task run for the rest of the flow
    run; the entries dropped, by structure.

    The flow run context holds an entry per component of every task run's result
    (``run_results``: it infers a dependency when a result is passed to another
    task; every input here is ``quote``d, so none is ever looked up) and a set per
    task run (``task_run_assets``: asset lineage, none here); the thread-pool task
    runner an Event per task run (``_cancel_events``, set only to cancel runs in
    flight). Some 50 objects an iteration, never freed: about 40 MB per 1,000
    iterations of the flow process (``bench/soak.py``). ``walk`` returns once every
    task run it started has ended, so between iterations none of them is needed.
    """
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None:  # not in a flow run
        return {}
    kept = {
        "run_results": ctx.run_results,
        "task_run_assets": ctx.task_run_assets,
        "cancel_events": getattr(ctx.task_runner, "_cancel_events", {}),
    }
    dropped = {name: len(entries) for name, entries in kept.items()}
    for entries in kept.values():
        entries.clear()
    return dropped


def _opts(ctx: RunContext, step: str, audit: bool):
    """The step's task with the run's policy, built once per run and step
    (``with_options`` builds a whole new Task, ~1 ms a call)."""
    policy = ctx.cfg.tasks
    key = (ctx.store.url, policy.model_dump_json(), step)
    if key not in _optioned:
        _optioned[key] = _with_policy(ctx, TASKS[step], audit)
    return _optioned[key]


def _with_policy(ctx: RunContext, t, audit: bool):
    policy = ctx.cfg.tasks
    return t.with_options(
        retries=policy.retries,
        retry_delay_seconds=policy.retry_delay_s,
        # No timeout_seconds: Prefect cannot interrupt a thread blocked on an actor.
        # tasks.timeout_s is the deadline of every wait inside the step instead
        # (``actors.deadline``), which fails the task so that Prefect retries it.
        # An audit (verify) looks at the engines now: its result is never reused.
        persist_result=not audit,
        result_storage=None if audit else result_storage(ctx),
    )


def result_storage(ctx: RunContext):
    """Persisted task results live under the run root, beside the ledger.

    Prefect wants the block saved server-side; it is saved once per flow process
    under a name derived from the run's URL.
    """
    url = f"{ctx.store.url}/prefect-results"
    if url in _saved_storage:
        return _saved_storage[url]
    from prefect.filesystems import LocalFileSystem, RemoteFileSystem

    if is_local(ctx.store.fs):  # storage.fs decides what is remote, not the URL's spelling
        block = LocalFileSystem(basepath=url.removeprefix("file://"))
    else:
        # The run's own S3 settings: botocore's defaults (60 s timeouts, several
        # attempts with backoff) once held a failed task run ~28 s writing its result
        # to an endpoint that was down, after its retries on the run's settings ended.
        block = RemoteFileSystem(basepath=url, settings=s3_settings(ctx.cfg.storage.s3))
    digest = hashlib.sha256(url.encode()).hexdigest()[:10]
    block.save(name=f"prefect-rl-results-{digest}", overwrite=True)
    _saved_storage[url] = block
    return block


_saved_storage: dict[str, object] = {}
_optioned: dict[tuple[str, str, str], object] = {}
