"""The evaluate-versions flow on the session's Ray cluster and Prefect server: two
versions of a tiny run on an object store (``storage.root: s3://...`` on moto's
HTTP S3 server, ``weights.transport: object-store``), four shards on prefect-ray's
RayTaskRunner, two engines of its own, which load each version from a verified
pull into their node cache (``engines.local_cache_dir``); the numbers equal a
single-process evaluation (``rollout.evaluation`` with an engine in this process,
on its own verified pull); a shard whose reward fails is retried alone; a rerun
reuses every shard (its result persisted on S3) and starts no engine; the
evaluation writes its record ``evals/<label>.json`` (and Prefect's shard results)
into the run and nothing else, its versions untouched; the run's tracker
(TensorBoard, a local folder) gets each version's numbers; a version that does
not exist is refused before any engine starts. The local-disk path (engines
loading the version folders themselves) is the e2e deployment test's
(tests/e2e/test_deployments.py::test_evaluate_versions_runs_as_a_deployment).

The run's engines decode one row at a time (engines.max_batch_size 1): on CPU a
row's numbers change in their last bits with what it is batched with, and the
sharded evaluation batches other rows together than the single-process one."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from tests.integration.eval_rewards import FAULTS, marker
from tests.s3_server import make_bucket, moto_s3

SIZE, SHARD, N = 8, 2, 2  # 8 prompts in 4 shards, pass@2


@pytest.fixture(scope="module")
def s3_url():
    with moto_s3() as url:
        make_bucket(url, "rl-evals")
        yield url


@pytest.fixture(scope="module")
def eval_run(ray_cluster, s3_url, tmp_path_factory):
    """A tiny run on S3 with v0 (prepare_run) and v1, v2 published as perturbed
    copies of it (no training: what is evaluated is any committed version). Its
    lease stays held and renewed, as by a training run in progress: evaluations
    run beside it. Its engines' cache and TensorBoard folder are local."""
    from bench.evaluation import publish_perturbed
    from flows.config import load_config
    from tasks import lease as run_lease
    from tasks.prepare import prepare_run

    tmp = tmp_path_factory.mktemp("evaluate")
    config = tmp / "run.yaml"
    config.write_text(
        "rollout:\n  reward: tests.integration.eval_rewards:digest_failing_once\n"
        "  trusted_reward_modules: [tests.integration.eval_rewards]\n"
    )
    name = f"eval-{uuid.uuid4().hex[:6]}"
    over = {
        "run.name": name,
        "storage.root": "s3://rl-evals/runs",
        "storage.s3.endpoint_url": s3_url,
        "weights.transport": "object-store",
        "engines.local_cache_dir": str(tmp / "engine-cache"),
        "engines.num_cpus_per_engine": 0.5,
        "engines.max_batch_size": 1,
        "eval.pass_threshold": 0.5,  # about half the answers pass (eval_rewards)
        "rollout.max_new_tokens": 4,
        "tracking.tensorboard.enabled": True,  # the run's tracker: the evaluation logs to it
        "tracking.tensorboard.log_dir": str(tmp / "tensorboard"),  # an s3 root needs one
    }
    ctx = prepare_run(load_config(config, over))
    for v in (1, 2):
        publish_perturbed(ctx, v, tmp / f"v{v}")
    try:
        yield ctx
    finally:
        run_lease.release(ctx)  # stops the renewals prepare_run started, then releases


def _params(ctx, **extra):
    return dict(
        run_name=ctx.run_name,
        storage_root=ctx.cfg.storage.root,
        s3_endpoint_url=ctx.cfg.storage.s3.endpoint_url,
        dataset="reverse",
        size=SIZE,
        n_samples=N,
        temperature=1.0,
        shard_size=SHARD,
        num_engines=2,
        shard_cpus=0.5,
        **extra,
    )


def _eval_actors(ctx) -> list[str]:
    from ray.util import list_named_actors

    return [
        a["name"]
        for a in list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"{ctx.run_name}/eval-")
    ]


def _single_process(ctx, v: int, cache) -> dict:
    """rollout.evaluation.evaluate on an embedded engine in this process, on version v
    pulled (verified) into ``cache``: a folder apart from the evaluation's engines'."""
    from engines.embedded.engine import EmbeddedEngine
    from rollout.evaluation import EvalConfig, evaluate

    cfg = ctx.cfg
    engine = EmbeddedEngine(ctx.store.pull_version(v, str(cache)), 0, cfg.engines, weight_version=v)

    def generate_groups(prompts, n, sampling, seeds, restart_fn=None):
        rows = [p for p in prompts for _ in range(n)]
        params = [dict(sampling, sampling_seed=int(s)) for group in seeds for s in group]
        out = engine.generate(rows, params)
        return [out[i * n : (i + 1) * n] for i in range(len(prompts))]

    ev = EvalConfig(dataset="reverse", size=SIZE, n_samples=N, pass_threshold=0.5)
    rollout = cfg.rollout.model_copy(update={"temperature": 1.0})
    return evaluate(ev, rollout, cfg.run.seed, v, v, ctx.tokenizer(), generate_groups, None)


def _tensorboard(ctx, tag: str) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` in the run's TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(ctx.cfg.tracking.tensorboard.log_dir, purge_orphaned_data=False)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _run_objects(ctx) -> dict[str, tuple[int, str]]:
    """(size, ETag) of every object of the run on S3 but what an evaluation may
    write, its record (``evals/``) and Prefect's shard results, and the lease the
    run's holder renews."""
    store = ctx.store
    found = store.fs.find(store.url, detail=True)
    mine = (f"{store.url}/evals/", f"{store.url}/prefect-results/", f"{store.url}/lease.json")
    return {p: (i["size"], i["ETag"]) for p, i in found.items() if not f"s3://{p}".startswith(mine)}


def _task_runs(flow_run_id) -> dict[str, object]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    return {r.name: r for r in runs}


def test_a_missing_version_is_refused_before_any_engine_starts(eval_run, prefect_api):
    from flows.evaluation import evaluate_versions

    state = evaluate_versions(**_params(eval_run, versions="1,7"), return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError) as e:
        state.result()
    assert "no committed version v7" in str(e.value)
    assert "committed versions: [0, 1, 2]" in str(e.value)
    assert _eval_actors(eval_run) == []


def test_two_versions_in_shards_equal_one_process_and_a_failed_shard_is_retried_alone(
    eval_run, prefect_api, tmp_path
):
    from flows.evaluation import evaluate_versions
    from storage import verify_dir
    from tasks.evaluation.plan import evaluated_prompts

    ctx = eval_run
    objects = _run_objects(ctx)  # the versions, run.json, ledger: the evaluation reads them
    manifests = {v: ctx.store.read_manifest(v) for v in ctx.store.committed_versions()}
    assert any("/weights/v000002/" in p for p in objects)
    prompts = evaluated_prompts(ctx, "reverse", SIZE)
    target = prompts[2 * SHARD]  # the first prompt of shard 2
    assert [p.label for p in prompts].count(target.label) == 1
    FAULTS.mkdir(exist_ok=True)
    marker(target.label).write_text("fail once")  # v1's shard 2 fails its first attempt

    state = evaluate_versions(**_params(ctx, versions="1..2", shard_retries=1), return_state=True)
    assert state.is_completed(), state.message
    out = state.result()
    assert not marker(target.label).exists()  # the fault fired
    runs = _task_runs(state.state_details.flow_run_id)
    shard_runs = {n: r for n, r in runs.items() if ":eval[" in n}
    assert len(shard_runs) == 8  # (2 versions) x (4 shards), each its own task run
    assert shard_runs[f"{ctx.run_name}:eval[v=1,shard=2]"].run_count == 2  # retried alone
    assert all(r.run_count == 1 for n, r in shard_runs.items() if "v=1,shard=2" not in n)
    loads = [n for n in runs if ":eval-load[" in n]
    assert len(loads) == 4  # each version on each of the 2 engines

    keys = ("pass_at_1_greedy", "pass_at_1", "pass_at_k")
    # The engines loaded verified pulls in the local cache (an s3 root: engines may
    # load from nowhere else, tasks.serving.engine.allowed_roots).
    cache = f"{ctx.cfg.engines.local_cache_dir}/{ctx.run_name}/weights"
    for v in (1, 2):
        for name in ("config.json", "model.safetensors", "manifest.json"):
            assert os.path.isfile(f"{cache}/v{v:06d}/{name}")
        assert verify_dir(f"{cache}/v{v:06d}") == manifests[v]
    for row in out["scores"]:
        reference = _single_process(ctx, row["version"], tmp_path / "baseline-cache")
        assert {k: row[k] for k in keys} == {k: reference[k] for k in keys}
        assert row["prompts"] == SIZE and row["response_tokens"] > 0
        assert 0 < row["pass_at_1"] < 1  # answers pass and fail
    assert out["scores"][0] != out["scores"][1]  # the versions differ

    assert out["record"] == f"{ctx.store.url}/evals/{out['label']}.json"
    record = json.loads(ctx.store.fs.cat_file(out["record"]))
    assert sorted(record["versions"]) == ["1", "2"]
    assert record["versions"]["2"]["pass_at_1_greedy"] == out["scores"][1]["pass_at_1_greedy"]
    # The run's TensorBoard holds each version's numbers at step = the version.
    logged = _tensorboard(ctx, f"eval/{out['label']}/pass_at_1")
    assert logged == [(r["version"], pytest.approx(r["pass_at_1"])) for r in out["scores"]]
    assert _eval_actors(ctx) == []  # its engines ended with it

    again = evaluate_versions(**_params(ctx, versions="1..2"), return_state=True)
    assert again.is_completed(), again.message
    assert [r["pass_at_1"] for r in again.result()["scores"]] == [
        r["pass_at_1"] for r in out["scores"]
    ]
    runs = _task_runs(again.state_details.flow_run_id)
    assert {r.state.name for n, r in runs.items() if ":eval[" in n} == {"Cached"}
    # The trackers already held those numbers: no second point at a version.
    assert _tensorboard(ctx, f"eval/{out['label']}/pass_at_1") == logged
    record = json.loads(ctx.store.fs.cat_file(out["record"]))
    assert record["logged"] == {"1": ["tensorboard"], "2": ["tensorboard"]}
    assert ctx.store.fs.find(f"{ctx.store.url}/prefect-results")  # what they were read from
    assert not any(":eval-load[" in n for n in runs)  # nothing to score: no engine started
    # Neither evaluation wrote into the run but its record and shard results, and the
    # run's holder kept its lease throughout.
    assert _run_objects(ctx) == objects
    lease = ctx.store.read_lease()
    assert lease is not None and lease.owner == ctx.owner and not lease.released
    assert {v: ctx.store.read_manifest(v) for v in manifests} == manifests


def test_the_cli_refuses_a_missing_version_without_a_flow_run(eval_run, capsys):
    from flows.cli import main

    root, endpoint = eval_run.cfg.storage.root, eval_run.cfg.storage.s3.endpoint_url
    args = ["--root", root, "--s3-endpoint-url", endpoint, "--versions", "2..4"]
    assert main(["evaluate", eval_run.run_name, *args]) == 2
    err = capsys.readouterr().err
    assert "no committed version v3, v4" in err and "committed versions: [0, 1, 2]" in err
