"""The Prefect tasks generated from the step declarations (``flows.step_tasks``):
each keeps the name, task-run name, parameters and cache key (the ledger identity
``{run}/{k}/{step}``) that the UI shows and a retried flow run's Cached relies on.
Running them under a real Prefect server is tests/integration (test_security's
warnings test) and tests/e2e."""

from __future__ import annotations

import inspect

from prefect.cache_policies import NO_CACHE

from flows.config import load_config
from flows.step_tasks import TASKS
from tasks.context import RunContext

# ledger key: (task name, task-run name, parameters)
EXPECTED = {
    "rollout": ("rollout", "{ctx.run_name}:rollout[k={k}]", ["ctx", "k"]),
    "rollout_head": ("rollout_head", "{ctx.run_name}:rollout_head[k={k}]", ["ctx", "k"]),
    "train": ("train", "{ctx.run_name}:train[k={k}]", ["ctx", "k"]),
    "save": ("save_checkpoint", "{ctx.run_name}:save[k={k}]", ["ctx", "k"]),
    "publish": ("publish_weights", "{ctx.run_name}:publish[k={k}]", ["ctx", "k"]),
    "reload": (
        "reload_engine",
        "{ctx.run_name}:reload[k={k},engine={engine_id}]",
        ["ctx", "k", "engine_id"],
    ),
    "verify": (
        "verify_engine",
        "{ctx.run_name}:verify[k={k},engine={engine_id}]",
        ["ctx", "k", "engine_id"],
    ),
    "evaluate": ("evaluate", "{ctx.run_name}:evaluate[k={k}]", ["ctx", "k"]),
    "iteration": ("finish_iteration", "{ctx.run_name}:finish[k={k}]", ["ctx", "k", "results"]),
}


def test_each_step_task_keeps_its_name_run_name_and_parameters():
    got = {
        key: (t.name, t.task_run_name, list(inspect.signature(t.fn).parameters))
        for key, t in TASKS.items()
    }
    assert got == EXPECTED
    assert len({t.task_key for t in TASKS.values()}) == len(TASKS)


def test_cache_keys_are_the_ledger_identity_and_verify_is_never_cached(tmp_path):
    over = {"run.name": "keys", "storage.root": str(tmp_path)}
    ctx = RunContext(load_config("configs/tiny-cpu.yaml", over), base_model_path=str(tmp_path))
    keys = {
        key: t.cache_key_fn(None, {"ctx": ctx, "k": 3, "engine_id": 1})
        for key, t in TASKS.items()
        if t.cache_key_fn is not None
    }
    assert keys == {
        "rollout": "keys/3/rollout",
        "rollout_head": "keys/3/rollout_head",
        "train": "keys/3/train",
        "save": "keys/3/save",
        "publish": "keys/3/publish",
        "reload": "keys/3/reload-e1",
        "evaluate": "keys/3/evaluate",
        "iteration": "keys/3/iteration",
    }
    assert TASKS["verify"].cache_key_fn is None
    assert TASKS["verify"].cache_policy is NO_CACHE
