"""Fixtures of the engine tests: weight variants of the tiny model and one engine group."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
from ray.util.placement_group import placement_group_table
from safetensors.torch import load_file, save_file

from engines.config import EngineConfig
from engines.group import EngineGroup


@pytest.fixture(scope="session")
def tiny_dir(tiny_model_dir) -> Path:
    return Path(tiny_model_dir)


def write_variant(src: Path, dst: Path, scale: float = 1.5, sharded: bool = False) -> Path:
    """A copy of the HF dir at ``src`` with every weight scaled (new outputs)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    state = {
        k: (v * scale).contiguous() for k, v in load_file(str(src / "model.safetensors")).items()
    }
    if not sharded:
        save_file(state, str(dst / "model.safetensors"))
        return dst
    names = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for shard, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(dst / shard))
        weight_map.update({k: shard for k in keys})
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return dst


@pytest.fixture(scope="session")
def tiny_v1(tiny_dir, tmp_path_factory) -> Path:
    return write_variant(tiny_dir, tmp_path_factory.mktemp("tiny") / "v1", sharded=True)


@pytest.fixture(scope="session")
def broken_dir(tiny_dir, tmp_path_factory) -> Path:
    """An HF dir whose weights miss a tensor: must be refused."""
    dst = tmp_path_factory.mktemp("tiny") / "broken"
    write_variant(tiny_dir, dst)
    state = load_file(str(dst / "model.safetensors"))
    state.pop(sorted(state)[0])
    save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.fixture
def cfg() -> EngineConfig:
    return EngineConfig(num_engines=2, num_cpus_per_engine=1.0, health_timeout_s=60.0)


def live_pg_names() -> set[str]:
    return {v["name"] for v in placement_group_table().values() if v["state"] != "REMOVED"}


@pytest.fixture
def pg_names():
    """Callable: names of the placement groups that exist now."""
    return live_pg_names


@pytest.fixture(scope="module")
def engine_group(request, ray_cluster, tiny_dir):
    """Two engines on v0 shared by one module's tests (an engine start costs ~8 s here),
    or as many as the module's ``ENGINES`` says (a module that drives one engine starts
    one). Module scope: the engines' CPUs are free again for the test folders after this one.

    Tests may change the served version and restart engines but leave every
    engine alive. Teardown is also the shutdown test: engines and their placement
    groups must be gone afterwards.
    """
    # Past the tiny model's 64 positions: the pause tests need long generations.
    engines = getattr(request.module, "ENGINES", 2)
    cfg = EngineConfig(
        num_engines=engines, num_cpus_per_engine=1.0, health_timeout_s=60.0, context_length=1024
    )
    group = EngineGroup(f"test-{uuid.uuid4().hex[:8]}", cfg, namespace="prefect-rl-test")
    group.start(str(tiny_dir), weight_version=0)
    yield group
    group.shutdown()
    assert all(group.handle(i) is None for i in range(cfg.num_engines))
    assert not {group.pg_name(i) for i in range(cfg.num_engines)} & live_pg_names()


@pytest.fixture
def run_name() -> str:
    """A fresh run name, so engine actors never collide across tests or sessions."""
    return f"test-{uuid.uuid4().hex[:8]}"
