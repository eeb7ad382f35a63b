"""The evaluate-versions flow: score published versions of a run on a held-out set,
each (version, shard) a task run on prefect-ray's RayTaskRunner.

    validate   the run exists (run.json), its storage root and config pass, every
               version asked for is committed (its manifest reads), the dataset
               loads: a refusal names what is missing and what exists, and
               nothing has started (no engine, no Ray, no lease)
    Ray        the run's cluster (ray.address, or the ``ray_address`` parameter) or
               a local one, joined through ``tasks.cluster``; the RayTaskRunner
               is entered after that and uses the same connection (left to
               itself it would ``ray.init()`` Ray's stale "auto")
    engines    the evaluation's own group (``tasks.evaluation.engines``), never the run's
    per version, in order:
      load     every engine loads the version and is checked to serve it
               (one ``load_version`` task per engine, no CPU asked)
      shards   every shard of the version at once (``evaluate_shard``, ``shard_cpus``
               CPUs each, retried alone); each shard's prompts are spread over all
               engines, so the version's shards share the engines
    results    per version pass@1 greedy and sampled, pass@k, mean reward, tokens:
               a table and a picture (artifacts), ``evals/{label}.json`` in the run
               (atomic), the run's trackers; the engines are shut down

Why version by version on all engines, not engines split by version: an engine
serves one version at a time, so splitting would give each version a fraction
of the engines and the slowest version's engines would decide the end, while
one version on all engines keeps every engine busy until the last shard and
reloads each engine once per version (a reload is seconds; a version's shards
are minutes at scale). Shards of a version run concurrently, so with shards >=
engines every engine always has a call queued.

Reuse: a shard's result is cached in the run's ``prefect-results`` under (run,
version and its manifest, the evaluated prompts' digest, shard, and the settings
its numbers depend on: sampling, reward, engine kind and count, batch, dtype); a
rerun with the same parameters shows finished shards as Cached, loads only the
versions that still have shards to score, and starts no engine when none has; a
rerun that changes any of them (another engine count) scores anew. Never takes the
run's lease and never writes into its versions, ledger or serving records.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.results import ResultStore
from prefect_ray import RayTaskRunner
from prefect_ray.context import remote_options
from pydantic import Field

from flows.evaluation_report import publish_artifacts
from flows.evaluation_tasks import evaluate_shard, load_version
from flows.iteration import result_storage
from flows.maintenance_flows import RunRef, open_run
from flows.params import takes
from rollout.evaluation import MAX_EVAL_SIZE
from rollout.sharded_eval import ShardScore, version_scores
from tasks.cluster import connect_ray
from tasks.context import RunContext
from tasks.evaluation import engines as eval_engines
from tasks.evaluation import record as eval_record
from tasks.evaluation.plan import VERSIONS_HELP, EvalPlan, eval_settings, make_plan, select_versions


class EvaluateParams(RunRef):
    versions: str = Field(
        "newest 2", title="Versions", description=VERSIONS_HELP, min_length=1, max_length=500
    )
    dataset: str | None = Field(
        None,
        title="Dataset",
        description="Builtin task name or a .jsonl/.parquet file (GSM8K format with the math "
        "reward); fields: the run's rollout.input_key/label_key. None: the run's eval.dataset, "
        "else rollout.task",
        max_length=1000,
    )
    size: int = Field(64, ge=1, le=MAX_EVAL_SIZE, title="Prompts (a file: its first rows)")
    n_samples: int = Field(4, ge=1, le=256, title="Sampled answers per prompt (pass@k's k)")
    temperature: float = Field(1.0, ge=0.0, le=2.0, title="Temperature of the sampled answers")
    shard_size: int = Field(16, ge=1, le=MAX_EVAL_SIZE, title="Prompts per shard")
    num_engines: int = Field(1, ge=1, le=256, title="Engines the evaluation starts")
    shard_cpus: float = Field(1.0, ge=0.0, le=64.0, title="CPUs each shard task asks of Ray")
    shard_retries: int = Field(2, ge=0, le=10, title="Retries of a failed shard")
    ray_address: str | None = Field(
        None, title="Ray address (optional)", description="None: the run's ray.address"
    )


@flow(name="evaluate-versions", flow_run_name="{run_name}:evaluate[{versions}]")
@takes(EvaluateParams)
def evaluate_versions(params: EvaluateParams) -> dict[str, Any]:
    log = get_run_logger()
    plan = plan_evaluation(params)  # refuses before anything starts
    log.info(
        "evaluating %s of run %r on %s: %d prompts in %d shards, %d engines",
        ", ".join(f"v{v}" for v in plan.versions),
        plan.run,
        plan.dataset,
        sum(len(s) for s in plan.shards),
        len(plan.shards),
        plan.ctx.cfg.engines.num_engines,
    )
    connect_ray(plan.ctx.cfg)
    shard_task = evaluate_shard.with_options(
        retries=params.shard_retries,
        retry_delay_seconds=plan.ctx.cfg.tasks.retry_delay_s,
        result_storage=result_storage(plan.ctx),
    )
    todo = shards_to_score(plan, shard_task)
    scores: list[dict[str, Any]] = []
    try:
        with RayTaskRunner(address=plan.ctx.cfg.ray.address) as runner:
            for v in plan.versions:
                t0 = time.perf_counter()
                shards, load_s = score_version(
                    runner, plan, v, shard_task, todo[v], params.shard_cpus
                )
                # wall_s: the version's load and shards, as the flow waited for them;
                # load_s: its part bringing the engines to v (the first: their start)
                wall_s = time.perf_counter() - t0
                scores.append({**version_scores(shards), "wall_s": wall_s, "load_s": load_s})
                log.info("v%d: %s", v, _line(scores[-1]))
    finally:
        if any(todo.values()):
            eval_engines.shutdown(plan)
    # The record first (the numbers are safe before any tracker is reached), then the
    # trackers that lack them, then the record again saying which trackers hold them.
    holding = eval_record.trackers_holding(plan, {v for v, shards in todo.items() if shards})
    record = eval_record.write_record(plan, scores, holding)
    held = eval_record.log_trackers(plan, scores, holding)
    if any(set(names) != set(holding.get(v, [])) for v, names in held.items()):
        record = eval_record.write_record(plan, scores, held)
    trackers = sorted({t for names in held.values() for t in names})
    url = eval_record.record_url(plan)
    publish_artifacts(plan.run, plan.label, scores, url)
    log.info("wrote %s%s", url, f"; trackers: {', '.join(trackers)}" if trackers else "")
    return {"record": url, "label": plan.label, "scores": scores, "plan": record["settings"]}


def plan_evaluation(params: EvaluateParams) -> EvalPlan:
    """The run's config with the evaluation's engines and temperature, the versions
    (each committed) and the prompts; raises naming the fix before anything starts."""
    ctx = open_run(params)
    cfg = ctx.cfg
    versions = select_versions(params.versions, ctx.store.committed_versions(), ctx.run_name)
    ray = (
        cfg.ray
        if params.ray_address is None
        else cfg.ray.model_copy(update={"address": params.ray_address})
    )
    cfg = cfg.model_copy(
        update={
            "engines": cfg.engines.model_copy(update={"num_engines": params.num_engines}),
            "rollout": cfg.rollout.model_copy(update={"temperature": params.temperature}),
            "ray": ray,
        }
    )
    ctx = RunContext(cfg=cfg, base_model_path=ctx.base_model_path)
    settings = eval_settings(cfg, params.n_samples, params.temperature)
    dataset = params.dataset or cfg.eval.dataset or cfg.rollout.task
    return make_plan(ctx, versions, dataset, params.size, params.shard_size, settings)


def shards_to_score(plan: EvalPlan, shard_task) -> dict[int, list[int]]:
    """By version, the shards whose result is not cached yet (their versions are loaded)."""
    store = ResultStore(result_storage=shard_task.result_storage)
    return {
        v: [s for s in range(len(plan.shards)) if not store.exists(plan.shard_key(v, s))]
        for v in plan.versions
    }


def score_version(
    runner: RayTaskRunner,
    plan: EvalPlan,
    v: int,
    shard_task,
    todo: list[int],
    shard_cpus: float,
) -> tuple[list[ShardScore], float]:
    """Load ``v`` on every engine (when a shard of it is to be scored), then every
    shard of ``v`` at once; every shard is waited for before a failure is raised,
    so the finished ones are persisted for the rerun. The shards' scores and the
    seconds the load took."""
    t0 = time.perf_counter()
    if todo:
        with remote_options(num_cpus=0):
            loads = [
                runner.submit(load_version, {"plan": plan, "version": v, "engine_id": e})
                for e in range(plan.ctx.cfg.engines.num_engines)
            ]
        for f in loads:
            f.result()
    load_s = time.perf_counter() - t0
    with remote_options(num_cpus=shard_cpus):
        futures = [
            runner.submit(shard_task, {"plan": plan, "version": v, "shard": s})
            for s in range(len(plan.shards))
        ]
    for f in futures:
        f.wait()
    failed = [s for s, f in enumerate(futures) if not f.state.is_completed()]
    if failed:
        first = futures[failed[0]].state
        raise RuntimeError(
            f"v{v}: shards {failed} of {len(futures)} failed ({first.message}); the other "
            "shards' results are kept: rerun with the same parameters to score only these"
        )
    return [ShardScore.from_json(f.result()) for f in futures], load_s


def _line(row: dict[str, Any]) -> str:
    return (
        f"pass@1 greedy {row['pass_at_1_greedy']:.3f}, pass@1 {row['pass_at_1']:.3f}, "
        f"pass@{row['n_samples']} {row['pass_at_k']:.3f}, mean reward {row['reward_mean']:.3f}, "
        f"{row['response_tokens']} tokens"
    )
