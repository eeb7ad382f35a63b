"""Everything a run can be told to read is checked before it starts
(``tasks.prepare.check_run``, or the config load): the prompt dataset and the
eval set row by row, the eval bounds, the trackers' folders and server, the
node resources a side is pinned to. Each refusal names the key (and the file
and line), and leaves no run state behind, so a fixed setting is not frozen."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from flows.config import ConfigError, load_config
from rollout.datasets import DatasetError, load_prompts
from storage.errors import StorageError
from tasks.prepare import check_run

GOOD_ROWS = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(4)]


def _jsonl(path: Path, rows: list, raw_line: bytes | None = None, at: int = 2) -> str:
    lines = [json.dumps(r).encode() for r in rows]
    if raw_line is not None:
        lines.insert(at - 1, raw_line)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def _cfg(root: Path, **sets):
    return load_config("configs/tiny-cpu.yaml", {"storage.root": str(root), **sets})


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def _no_run_state(root: Path) -> bool:
    return not (root / "tiny-cpu").exists()  # no lease.json, run.json or v0


# -- the prompt dataset (rollout.task) ------------------------------------------


def test_a_bad_prompt_row_is_refused_before_any_run_state_and_a_fixed_copy_runs(tmp_path):
    root = tmp_path / "runs"
    bad = _jsonl(tmp_path / "bad.jsonl", GOOD_ROWS, raw_line=b'{"prompt": "x"}', at=3)
    with pytest.raises(ConfigError, match=rf"rollout.task: {bad}:3: missing key 'label'"):
        check_run(_cfg(root, **{"rollout.task": bad}))
    assert _no_run_state(root)  # nothing frozen: the run may point at another file
    (tmp_path / "fixed").mkdir()
    fixed = _jsonl(tmp_path / "fixed" / "good.jsonl", GOOD_ROWS)
    assert check_run(_cfg(root, **{"rollout.task": fixed}))  # the base model's path


def test_a_missing_prompt_dataset_is_refused_with_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.task '.*nope.jsonl' is neither a builtin"):
        check_run(_cfg(tmp_path, **{"rollout.task": str(tmp_path / "nope.jsonl")}))


def test_a_non_utf8_byte_names_the_file_and_line(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", GOOD_ROWS, raw_line=b'{"prompt": "\xff", "label": "1"}')
    with pytest.raises(DatasetError, match=rf"{path}:2: not UTF-8 \(byte 0xff at column 13\)"):
        load_prompts(path, "prompt", "label")


def test_deep_nesting_names_the_file_and_line(tmp_path):
    deep = b'{"prompt": "a", "label": "1", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path = _jsonl(tmp_path / "d.jsonl", GOOD_ROWS, raw_line=deep)
    with pytest.raises(DatasetError, match=rf"{path}:2: nested too deeply"):
        load_prompts(path, "prompt", "label")


def test_a_line_separator_inside_a_json_string_stays_one_row(tmp_path):
    # U+2028 is valid inside a JSON string; it must not split the row in two.
    row = {"prompt": "a\u2028b", "label": "1"}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    [prompt] = load_prompts(path, "prompt", "label")
    assert prompt.text == "a\u2028b"


# -- the eval set and its bounds -------------------------------------------------


def test_a_missing_or_bad_eval_set_is_refused_before_the_run(tmp_path):
    root = tmp_path / "runs"
    missing = str(tmp_path / "eval.jsonl")
    with pytest.raises(ConfigError, match=r"eval.dataset '.*eval.jsonl' is neither"):
        check_run(_cfg(root, **{"eval.interval": 2, "eval.dataset": missing}))
    bad = _jsonl(tmp_path / "evalbad.jsonl", GOOD_ROWS, raw_line=b"{not json")
    with pytest.raises(ConfigError, match=rf"eval.dataset: {bad}:2: not valid JSON"):
        check_run(_cfg(root, **{"eval.interval": 2, "eval.dataset": bad}))
    assert _no_run_state(root)
    # Evaluation off: the eval set is never read, so it is not checked either.
    assert check_run(_cfg(root, **{"eval.interval": 0, "eval.dataset": missing}))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_pass_threshold_is_refused_with_the_key(value):
    with pytest.raises(ConfigError, match=r"eval.pass_threshold: Input should be a finite"):
        load_config(None, {"eval.pass_threshold": value})


def test_an_eval_size_past_the_cap_is_refused_with_the_key():
    with pytest.raises(ConfigError, match=r"eval.size: Input should be less than or equal"):
        load_config(None, {"eval.size": 10**12})
    assert load_config(None, {"eval.size": 100_000}).eval.size == 100_000


# -- trackers --------------------------------------------------------------------


def test_a_tensorboard_log_dir_that_is_a_file_is_refused_with_the_key(tmp_path):
    (tmp_path / "tb").write_text("not a folder")
    cfg = _cfg(
        tmp_path / "runs",
        **{
            "tracking.tensorboard.enabled": True,
            "tracking.tensorboard.log_dir": str(tmp_path / "tb"),
        },
    )
    with pytest.raises(StorageError, match=r"tracking.tensorboard.log_dir .*tb: .* is a file"):
        check_run(cfg)
    assert _no_run_state(tmp_path / "runs")


def test_a_wandb_dir_under_a_file_is_refused_with_the_key(tmp_path):
    (tmp_path / "f").write_text("")
    cfg = _cfg(
        tmp_path,
        **{"tracking.wandb.enabled": True, "tracking.wandb.dir": str(tmp_path / "f" / "w")},
    )
    with pytest.raises(StorageError, match=r"tracking.wandb.dir .*: its parent .*f is a file"):
        check_run(cfg)


def test_an_mlflow_server_that_does_not_answer_is_refused_with_the_key_and_uri(tmp_path):
    uri = f"http://127.0.0.1:{dead_port()}"
    cfg = _cfg(
        tmp_path / "runs",
        **{"tracking.mlflow.enabled": True, "tracking.mlflow.tracking_uri": uri},
    )
    with pytest.raises(ValueError, match=rf"tracking.mlflow.tracking_uri {uri}: no MLflow"):
        check_run(cfg)
    assert _no_run_state(tmp_path / "runs")


def test_an_mlflow_server_that_answers_passes(tmp_path):
    """Any HTTP answer means a server is up (here a real one that answers 404)."""
    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.handle_request, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}"
        check_run(
            _cfg(tmp_path, **{"tracking.mlflow.enabled": True, "tracking.mlflow.tracking_uri": uri})
        )
    finally:
        server.server_close()


def test_an_mlflow_file_store_must_be_a_writable_folder(tmp_path):
    (tmp_path / "db").write_text("")
    for uri in (f"sqlite:///{tmp_path}/db/mlflow.db", f"file://{tmp_path}/db", f"{tmp_path}/db"):
        cfg = _cfg(
            tmp_path, **{"tracking.mlflow.enabled": True, "tracking.mlflow.tracking_uri": uri}
        )
        with pytest.raises(StorageError, match=r"tracking.mlflow.tracking_uri .*db.* is a file"):
            check_run(cfg)


# -- node resources --------------------------------------------------------------


@pytest.mark.parametrize("key", ["engines.node_resource", "train.node_resource"])
@pytest.mark.parametrize(
    "name", ["node:__internal_head__", "node:__anything", "memory", "object_store_memory"]
)
def test_rays_own_resource_names_are_refused_at_load(key, name):
    with pytest.raises(ConfigError, match=rf"{key} '{name}' is not a custom resource"):
        load_config(None, {key: name, "weights.transport": "disk"})


def test_a_maintenance_flow_opens_a_run_whose_dataset_moved(tmp_path):
    """gc and reload read no dataset and log to no tracker: a dataset moved away
    since the run, or a tracking server stopped, must not block them."""
    from flows.maintenance_flows import RunRef, open_run
    from storage.run_store import RunStore

    data = _jsonl(tmp_path / "d.jsonl", GOOD_ROWS)
    cfg = _cfg(tmp_path / "runs", **{"rollout.task": data, "eval.interval": 1})
    RunStore(cfg.storage, cfg.run.name).write_run_json({"config": cfg.model_dump(mode="json")})
    Path(data).unlink()
    ctx = open_run(RunRef(run_name=cfg.run.name, storage_root=cfg.storage.root))
    assert ctx.cfg.rollout.task == data


def test_an_fp32_trainer_beside_sglang_in_bf16_is_named_at_start(tmp_path, caplog):
    from tasks.prepare import warn_precision_gap

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    cfg = _cfg(tmp_path, **{"engines.kind": "sglang", "weights.transport": "disk"})
    with caplog.at_level("WARNING", logger="prefect_rl.prepare"):
        message = warn_precision_gap(cfg, str(model))
    assert "train.compute_dtype: bfloat16" in message and "--dtype float32" in message
    assert message in caplog.text
    # The remedies each close the gap: bf16 compute, or SGLang serving fp32.
    bf16 = _cfg(tmp_path, **{"engines.kind": "sglang", "train.compute_dtype": "bfloat16"})
    assert warn_precision_gap(bf16, str(model)) is None
    fp32_served = cfg.model_copy(
        update={
            "engines": cfg.engines.model_copy(
                update={
                    "sglang": cfg.engines.sglang.model_copy(
                        update={"extra_args": ["--dtype", "float32"]}
                    )
                }
            )
        }
    )
    assert warn_precision_gap(fp32_served, str(model)) is None
    # The embedded engine serves what the trainer holds.
    assert warn_precision_gap(_cfg(tmp_path), str(model)) is None


# -- LoRA target modules (train.lora) ----------------------------------------------


def test_a_lora_target_the_base_model_lacks_is_refused_before_any_run_state(tmp_path):
    root = tmp_path / "runs"
    with pytest.raises(ConfigError, match=r"\['qkv_proj'\].*linear layers are \[.*'q_proj'"):
        check_run(_cfg(root, **{"train.lora.target_modules": ["q_proj", "qkv_proj"]}))
    assert _no_run_state(root)
    assert check_run(_cfg(root, **{"train.lora.target_modules": ["q_proj", "down_proj"]}))
