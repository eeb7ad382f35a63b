"""One RL iteration k as a Prefect flow of tasks.

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
   reload[k, e] for each engine e            (mapped: one task run per engine, retried alone)
            │
   verify[k, e] for each engine e            (engine e serves "k", else the task fails)
            │
      finish[k]  ──► metrics row + ledger/iter_k/iteration.json (the iteration's commit)

The DAG is ``tasks.steps.ITERATION``, written once; this flow and the plain
driver (``flows/driver.py``) both walk it. Each arrow waits for the one above
it. Every step gets the same cross-cutting concerns from ``tasks.runner.run``:
ledger first, timing, its colocation turn, its fault-injection point, warnings
collected, the commit. Prefect adds retries, timeouts and the result cache
(``{run}/{k}/{step}``) through ``_opts``; verify alone is never cached.
Nothing but storage URIs and small records passes between tasks. Colocated (``placement.colocate``), train ranks
and engines take turns on shared devices: each step first wakes the side it
works with and puts the other to sleep (``tasks.colocate``). Shutdown: when
healthy, ``rl_training`` ends the actors after the last iteration. After a
crash nothing needs cleaning by hand: a rerun finds the first uncommitted step
in the ledger and heals from storage.
"""

from __future__ import annotations

import hashlib
from typing import Any

from prefect import flow, unmapped

from flows.artifacts import iteration_table
from storage.fs import is_local
from tasks import rl_tasks, steps
from tasks.context import RunContext


def _opts(ctx: RunContext, t, retries: bool = True):
    policy = ctx.cfg.tasks
    return t.with_options(
        retries=policy.retries if retries else 0,
        retry_delay_seconds=policy.retry_delay_s,
        timeout_seconds=policy.timeout_s,
        persist_result=True,
        result_storage=result_storage(ctx),
    )


def result_storage(ctx: RunContext):
    """Persisted task results live under the run root, beside the ledger.

    Task runs on Ray workers need the block saved server-side; it is saved once
    per flow process under a name derived from the run's URL.
    """
    url = f"{ctx.store.url}/prefect-results"
    if url in _saved_storage:
        return _saved_storage[url]
    from prefect.filesystems import LocalFileSystem, RemoteFileSystem

    if is_local(ctx.store.fs):  # storage.fs decides what is remote, not the URL's spelling
        block = LocalFileSystem(basepath=url.removeprefix("file://"))
    else:
        settings = {}
        if ctx.cfg.storage.s3.endpoint_url:
            settings["client_kwargs"] = {"endpoint_url": ctx.cfg.storage.s3.endpoint_url}
        block = RemoteFileSystem(basepath=url, settings=settings)
    digest = hashlib.sha256(url.encode()).hexdigest()[:10]
    block.save(name=f"prefect-rl-results-{digest}", overwrite=True)
    _saved_storage[url] = block
    return block


_saved_storage: dict[str, object] = {}


@flow(name="rl-iteration", flow_run_name="{ctx.run_name}:iter[k={k}]", log_prints=True)
def rl_iteration(ctx: RunContext, k: int) -> dict[str, Any]:
    futures: dict[str, Any] = {}
    upstream: Any = None  # the futures of the step before: one, or one per engine
    for step in steps.ITERATION:
        task = _opts(ctx, rl_tasks.TASKS[step.name])
        if step.per_engine:
            engines = step.engine_ids(ctx)
            # Per engine after per engine: engine e waits for its own upstream only.
            wait = {"upstream": upstream if isinstance(upstream, list) else unmapped(upstream)}
            upstream = task.map(unmapped(ctx), k, engines, **wait)
            futures.update({step.key(e): f for e, f in zip(engines, upstream)})
        else:
            wait = {} if upstream is None else {"upstream": upstream}
            upstream = futures[step.key()] = task.submit(ctx, k, **wait)
    results = {key: fut.result() for key, fut in futures.items()}
    row = _opts(ctx, rl_tasks.finish_iteration).submit(ctx, k, results).result()
    iteration_table(ctx.run_name, k, row)
    return {**results, "row": row}
