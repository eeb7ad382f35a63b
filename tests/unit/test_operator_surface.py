"""What an operator meets around a run: the Ray address checked in seconds (never
Ray's stale "auto"), top-level flow parameters from one model, the message that
says how to continue, and ``prefect-rl runs``."""

from __future__ import annotations

import socket

import pytest

from flows.cli import main
from flows.config import ConfigError, load_config
from flows.params import takes
from flows.progress import continue_hint
from storage.run_store import RunStore
from tasks.cluster import check_address, gcs_endpoint, shortfall


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def test_a_dead_ray_address_is_refused_with_the_address_in_the_message():
    address = f"127.0.0.1:{dead_port()}"
    with pytest.raises(ConfigError, match=f"no Ray cluster answers at ray.address {address}"):
        check_address(address)


@pytest.mark.parametrize("address", ["auto", "local", "6379", "ray://:10001"])
def test_an_address_that_names_no_cluster_is_refused(address):
    with pytest.raises(ConfigError, match="ray.address"):
        gcs_endpoint(address)


def test_the_cli_refuses_a_dead_cluster_before_any_run_state(tmp_path, capsys):
    address = f"127.0.0.1:{dead_port()}"
    code = main(
        ["run", "configs/tiny-cpu.yaml", "--set", f"storage.root={tmp_path}"]
        + ["--set", f"ray.address={address}"]
    )
    assert code == 2
    assert address in capsys.readouterr().err
    assert not (tmp_path / "tiny-cpu").exists()  # no lease, run.json or v0


def test_flow_parameters_are_the_models_fields_at_the_top_level():
    from prefect.utilities.callables import parameter_schema

    from flows.maintenance_flows import GcParams, gc_versions_flow, reload_engines_flow

    schema = parameter_schema(gc_versions_flow).model_dump()
    assert set(schema["properties"]) == set(GcParams.model_fields)
    assert schema["properties"]["keep_last"]["minimum"] == 1  # the model's bounds
    assert "Versions and checkpoints to keep" in schema["properties"]["keep_last"]["description"]
    assert reload_engines_flow.validate_parameters({"version": "3"})["version"] == 3
    with pytest.raises(Exception, match="greater than or equal to 1"):
        gc_versions_flow.validate_parameters({"keep_last": 0})


def test_takes_hands_the_function_one_validated_model():
    from pydantic import BaseModel, Field

    class Params(BaseModel):
        version: int = Field(..., ge=0)
        name: str = "x"

    @takes(Params)
    def fn(params: Params) -> Params:
        return params

    assert fn(version=2) == Params(version=2)
    assert fn(3, name="y") == Params(version=3, name="y")


def test_the_continue_hint_repeats_the_users_settings_with_more_iterations():
    hint = continue_hint(
        "configs/tiny-cpu.yaml", ["run.iterations=25", "run.name=exp 2", "storage.root=/d"], 25
    )
    assert (
        "prefect-rl run configs/tiny-cpu.yaml --set 'run.name=exp 2' --set storage.root=/d "
        "--set run.iterations=35" in hint
    )
    assert "extra_iterations=10" in hint


def test_runs_lists_each_run_with_its_state(tmp_path, capsys):
    cfg = load_config("configs/tiny-cpu.yaml", {"storage.root": str(tmp_path)})
    done = RunStore(cfg.storage, "done")
    done.write_run_json({"config": cfg.model_dump(mode="json")})
    for k in (1, 2):
        done.append_metrics(k, {"iteration": k, "reward_mean": 0.5})
    done.record_serving(0, 2)
    done.record_serving(1, 1)
    held = RunStore(cfg.storage, "held")
    held.write_run_json({"config": cfg.model_dump(mode="json")})
    held.acquire_lease("otherhost:12", 60)
    (tmp_path / "not-a-run").mkdir()
    assert main(["runs", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["run", "iterations", "newest", "lease"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {"done", "held"}
    assert rows["done"].split()[1] == "2" and "e0=v2, e1=v1" in rows["done"]
    assert "held by otherhost:12 (live)" in rows["held"]


def test_runs_exits_0_and_lists_a_damaged_run_beside_a_healthy_one(tmp_path, capsys):
    cfg = load_config("configs/tiny-cpu.yaml", {"storage.root": str(tmp_path)})
    for name in ("healthy", "torn"):
        store = RunStore(cfg.storage, name)
        store.write_run_json({"config": cfg.model_dump(mode="json")})
        store.append_metrics(1, {"iteration": 1, "reward_mean": 0.5})
    (tmp_path / "torn" / "lease.json").write_text('{"owner": "a')  # a writer's torn write
    (tmp_path / "log").write_text("a log file beside the runs\n")
    assert main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in out[1:]}
    assert set(rows) == {"healthy", "torn"}
    assert rows["healthy"].split()[1:4] == ["1", "-", "free"]
    assert "damaged lease.json" in rows["torn"] and rows["torn"].split()[1] == "1"


def test_a_complete_run_answers_at_once_with_how_to_continue(tmp_path, capsys):
    sets = [f"storage.root={tmp_path}", "run.name=done", "run.iterations=2"]
    cfg = load_config("configs/tiny-cpu.yaml", sets)
    store = RunStore(cfg.storage, "done")
    store.write_run_json({"config": cfg.model_dump(mode="json")})
    for k in (1, 2):
        store.append_metrics(k, {"iteration": k, "reward_mean": 0.5})
        store.write_record(k, "iteration", {"result": {}})
    code = main(["run", "configs/tiny-cpu.yaml", *[a for s in sets for a in ("--set", s)]])
    out = capsys.readouterr().out
    assert code == 0
    assert "nothing to do: run 'done' is complete (2 iterations committed" in out
    assert "--set run.name=done --set run.iterations=12" in out
    assert store.read_lease() is None  # no lease, no flow run, no Ray: nothing started


def test_a_cluster_too_small_for_the_runs_actors_is_refused_with_what_it_needs():
    cfg = load_config("configs/tiny-cpu.yaml", ["engines.num_engines=4"])  # 4 + 1 CPUs
    why = shortfall(cfg, "10.0.0.1:6379", {"CPU": 2.0})
    assert "has 2 CPUs but the run's engines and train ranks reserve 5" in why
    assert "ray start --head --num-cpus=9" in why
    gpu = load_config("configs/gpu-0.5b.yaml")  # half a GPU each for engine and trainer
    assert "has 0 GPUs but the run's engines and train ranks reserve 1" in shortfall(
        gpu, "10.0.0.1:6379", {"CPU": 8.0}
    )
    assert shortfall(gpu, "10.0.0.1:6379", {"CPU": 8.0, "GPU": 1.0}) is None
