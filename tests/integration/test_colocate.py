"""Colocated placement (``placement.colocate: true``) on CPU, on real Ray actors.

Through the Prefect flow: every step that works on a device records the
states it put the actors in, and they take turns (engines awake for rollout
and reload, train ranks awake for train/save/publish and for an in-memory
push), also in the steps retried after a killed engine and a killed train
rank. On CPU a sleep frees nothing, but the calls are the ones a GPU run
makes. Placement: train rank i and engine i sit on bundle i of the one shared
group, which neither a trainer release nor an engine restart removes.
"""

from __future__ import annotations

import time

import pytest
import ray
from ray.util.placement_group import placement_group_table

from flows.config import load_config
from storage.run_store import RunStore
from tasks import lease as run_lease
from tasks.prepare import prepare_run
from tasks.serving.transports import ensure_engine_serves

CONFIG = "configs/tiny-cpu.yaml"
TRAIN_CPUS, ENGINE_CPUS = 0.5, 0.25  # distinct, so a bundle's free CPUs tell who left it


def _overrides(tmp_path, name: str, **extra) -> dict:
    return {
        "run.name": name,
        "run.iterations": 2,
        "run.save_interval": 1,
        "storage.root": str(tmp_path / "runs"),
        "rollout.batch_size": 4,
        "rollout.n_samples_per_prompt": 4,
        "placement.colocate": True,
        "engines.num_engines": 2,
        "engines.num_cpus_per_engine": ENGINE_CPUS,
        "train.num_workers": 2,
        "train.num_cpus_per_worker": TRAIN_CPUS,
        "tasks.retry_delay_s": [0.1],
        **extra,
    }


def _pg_names() -> set[str]:
    return {i["name"] for i in placement_group_table().values() if i["state"] != "REMOVED"}


TRAIN = {"train": ["awake", "awake"], "engines": {"0": "asleep", "1": "asleep"}}


# Retried steps start from actors in another state: a new engine and new train ranks.
FAULTS = [
    {"step": "reload", "iteration": 1, "kind": "kill_actor"},
    {"step": "train", "iteration": 2, "kind": "kill_actor"},
]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["disk", "tensor"])
def test_colocated_steps_take_turns_through_the_flow(ray_cluster, prefect_api, tmp_path, transport):
    from flows.rl_training import rl_training

    name = f"colo-{transport}"
    overrides = _overrides(tmp_path, name, **{"weights.transport": transport, "faults": FAULTS})
    state = rl_training(config_path=CONFIG, overrides=overrides, return_state=True)
    assert state.is_completed(), state
    assert state.result()["iterations"] == [1, 2]

    store = RunStore(load_config(CONFIG, overrides).storage, name)
    assert store.committed_versions() == [0, 1, 2]
    for f in FAULTS:  # both faults fired
        assert store.fs.exists(f"{store.url}/faults/{f['step']}-{f['iteration']:06d}-kill_actor")

    def memory(k: int, step: str) -> dict:
        return store.read_record(k, step)["result"]["memory"]

    pushed = transport == "tensor"
    for k in (1, 2):
        # Rollout 1 runs before any train rank exists; later ones put them to sleep.
        asleep = ["asleep", "asleep"] if k > 1 else []
        assert memory(k, "rollout") == {"train": asleep, "engines": {"0": "awake", "1": "awake"}}
        for step in ("train", "save", "publish"):
            assert memory(k, step) == TRAIN, (k, step)
        for e in (0, 1):
            # A disk reload needs the devices for the engine alone; a push needs both sides.
            ranks = ["awake" if pushed else "asleep"] * 2
            assert memory(k, f"reload-e{e}") == {"train": ranks, "engines": {str(e): "awake"}}
    # (The flow completed, so every verify found engines on the version of their iteration.)
    # The end of the run removed the shared group with the engines.
    assert f"{name}/colocate-pg" not in _pg_names()


def _free_cpus(pg_id: str, bundle: int) -> float:
    return ray.available_resources().get(f"CPU_group_{bundle}_{pg_id}", 0.0)


def _wait_free(pg_id: str, expected: list[float], timeout: float = 20.0) -> None:
    """Wait until bundle b of the group has expected[b] CPUs free (resource views lag)."""
    deadline = time.monotonic() + timeout
    while True:
        free = [round(_free_cpus(pg_id, b), 3) for b in range(len(expected))]
        if free == expected or time.monotonic() > deadline:
            assert free == expected
            return
        time.sleep(0.1)


def test_shared_placement_group_holds_both_sides(ray_cluster, tmp_path):
    ctx = prepare_run(load_config(None, _overrides(tmp_path, "colo-pg")))
    trainer, group, shared = ctx.trainer(), ctx.engines(), ctx.placement()
    try:
        trainer.ensure_state(0, ctx.base_model_path)
        for e in (0, 1):
            ensure_engine_serves(ctx, group, e, 0)
        [pg_id] = [i for i, v in placement_group_table().items() if v["name"] == shared.name]
        info = placement_group_table()[pg_id]
        assert info["state"] == "CREATED"
        assert list(info["bundles"].values()) == [{"CPU": TRAIN_CPUS + ENGINE_CPUS}] * 2
        names = _pg_names()
        assert f"{ctx.run_name}/train-pg" not in names
        assert not any(n.startswith(f"{ctx.run_name}/engine-pg/") for n in names)
        _wait_free(pg_id, [0.0, 0.0])  # each bundle holds one train rank and one engine

        # Train rank 1 and engine 0 leave: exactly their bundles' shares come free.
        ray.kill(trainer.actors()[1], no_restart=True)
        ray.kill(group.handle(0), no_restart=True)
        _wait_free(pg_id, [ENGINE_CPUS, TRAIN_CPUS])

        # An engine restart and a trainer release keep the shared group.
        ensure_engine_serves(ctx, group, 0, 0)
        trainer.release()
        assert placement_group_table()[pg_id]["state"] == "CREATED"
        _wait_free(pg_id, [TRAIN_CPUS, TRAIN_CPUS])
    finally:
        trainer.shutdown()
        assert shared.name in _pg_names()  # engines still live in it
        group.shutdown()
        run_lease.release(ctx)  # renewals stopped first, then released
    assert shared.name not in _pg_names()
