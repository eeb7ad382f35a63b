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

Each arrow waits for the one above it. Nothing but storage URIs and small
records passes between tasks. Colocated (``placement.colocate``), train ranks
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
from tasks import rl_tasks
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

    if "://" in url and not url.startswith("file://"):
        settings = {}
        if ctx.cfg.storage.s3.endpoint_url:
            settings["client_kwargs"] = {"endpoint_url": ctx.cfg.storage.s3.endpoint_url}
        block = RemoteFileSystem(basepath=url, settings=settings)
    else:
        block = LocalFileSystem(basepath=url.removeprefix("file://"))
    digest = hashlib.sha256(url.encode()).hexdigest()[:10]
    block.save(name=f"prefect-rl-results-{digest}", overwrite=True)
    _saved_storage[url] = block
    return block


_saved_storage: dict[str, object] = {}


@flow(name="rl-iteration", flow_run_name="{ctx.run_name}:iter[k={k}]", log_prints=True)
def rl_iteration(ctx: RunContext, k: int) -> dict[str, Any]:
    engines = list(range(ctx.cfg.engines.num_engines))
    rollout = _opts(ctx, rl_tasks.rollout).submit(ctx, k)
    train = _opts(ctx, rl_tasks.train).submit(ctx, k, upstream=rollout)
    save = _opts(ctx, rl_tasks.save_checkpoint).submit(ctx, k, upstream=train)
    publish = _opts(ctx, rl_tasks.publish_weights).submit(ctx, k, upstream=save)
    reloads = _opts(ctx, rl_tasks.reload_engine).map(unmapped(ctx), k, engines, upstream=unmapped(publish))
    verifies = _opts(ctx, rl_tasks.verify_engine).map(unmapped(ctx), k, engines, upstream=reloads)
    results: dict[str, Any] = {
        "rollout": rollout.result(),
        "train": train.result(),
        "save": save.result(),
        "publish": publish.result(),
    }
    for e, fut in zip(engines, reloads):
        results[f"reload-e{e}"] = fut.result()
    for e, fut in zip(engines, verifies):
        results[f"verify-e{e}"] = fut.result()
    row = _opts(ctx, rl_tasks.finish_iteration).submit(ctx, k, results).result()
    iteration_table(ctx.run_name, k, row)
    return {**results, "row": row}
