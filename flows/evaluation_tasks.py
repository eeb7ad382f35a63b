"""Prefect tasks of the evaluate-versions flow: load a version on one engine, score
one (version, shard).

Both run on prefect-ray's ``RayTaskRunner`` (``flows.evaluation``), i.e. as Ray
tasks on the cluster: ``load_version`` asks for no CPU (it waits on an engine),
``evaluate_shard`` for ``shard_cpus`` CPUs and never a GPU (the engines hold the
GPUs; scoring is CPU work). A shard's result is persisted and cached under
``EvalPlan.shard_key`` (run, version and its manifest, prompts' digest, shard,
``EvalSettings``: sampling, reward, engines), so a rerun with the same parameters
shows finished shards as Cached and runs only the rest; a failed shard is retried
alone (``retries``). The work is ``tasks.evaluation.engines``; this module only wraps it.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.evaluation.engines import run_shard, serve_version
from tasks.evaluation.plan import EvalPlan


@task(
    name="load_version",
    task_run_name="{plan.ctx.run_name}:eval-load[v={version},engine={engine_id}]",
    cache_policy=NO_CACHE,  # what an engine serves is looked at now, never cached
    retries=2,
    retry_delay_seconds=[2, 5],
)
def load_version(plan: EvalPlan, version: int, engine_id: int) -> dict[str, Any]:
    return serve_version(plan, engine_id, version)


def _shard_key(context: Any, parameters: dict[str, Any]) -> str:
    return parameters["plan"].shard_key(parameters["version"], parameters["shard"])


@task(
    name="evaluate_shard",
    task_run_name="{plan.ctx.run_name}:eval[v={version},shard={shard}]",
    cache_key_fn=_shard_key,
    persist_result=True,
)
def evaluate_shard(plan: EvalPlan, version: int, shard: int) -> dict[str, Any]:
    return run_shard(plan, version, shard).to_json()
