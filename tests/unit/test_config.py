"""Config loading: every shipped config parses; bad input names the fix."""

from pathlib import Path

import pytest

from flows.config import ConfigError, RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)


def test_overrides_apply_with_yaml_types():
    cfg = load_config(
        ROOT / "configs/tiny-cpu.yaml",
        [
            "run.iterations=3",
            "storage.root=s3://b/p",
            "weights.transport=object-store",
            "engines.num_engines=2",
        ],
    )
    assert cfg.run.iterations == 3
    assert cfg.storage.root == "s3://b/p"
    assert cfg.engines.num_engines == 2


def test_unknown_key_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("run:\n  itrations: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'run.itrations'"):
        load_config(p)


def test_unknown_override_is_named():
    with pytest.raises(ConfigError, match=r"unknown key 'rollout.batchsize'"):
        load_config(None, ["rollout.batchsize=4"])


def test_bad_values_are_explained(tmp_path):
    with pytest.raises(ConfigError, match=r"run.iterations"):
        load_config(None, ["run.iterations=-1"])
    with pytest.raises(ConfigError, match=r"n_samples_per_prompt must be at least 2"):
        load_config(None, ["rollout.n_samples_per_prompt=1"])
    with pytest.raises(ConfigError, match=r"divisible by train.num_workers"):
        load_config(
            None, ["rollout.batch_size=3", "rollout.n_samples_per_prompt=3", "train.num_workers=2"]
        )
    with pytest.raises(ConfigError, match=r"not a valid run name"):
        load_config(None, ["run.name=../escape"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, ["run.iterations"])


def test_validation_does_not_rewrite_settings():
    cfg = load_config(None, ["rollout.temperature=0.7", "train.lr=0.0003"])
    assert cfg.rollout.temperature == 0.7
    assert cfg.train.lr == 0.0003


def test_precision_settings_are_checked_at_load():
    cfg = load_config(None, ["train.compute_dtype=bfloat16"])
    assert cfg.train.compute_dtype == "bfloat16" and cfg.model.dtype == "float32"
    with pytest.raises(ConfigError, match=r"float16 needs loss scaling.*use bfloat16"):
        load_config(None, ["train.compute_dtype=float16"])
    with pytest.raises(ConfigError, match=r"set model.dtype: float32"):
        load_config(None, ["train.compute_dtype=float32", "model.dtype=bfloat16"])
    # megatron: fp32 master parameters with a bf16 twin model, as the torch backend
    mixed = load_config(None, ["train.backend=megatron", "train.compute_dtype=bfloat16"])
    assert (mixed.train.compute_dtype, mixed.model.dtype) == ("bfloat16", "float32")
    with pytest.raises(ConfigError, match=r"on_exceed"):
        load_config(None, ["train.mismatch.on_exceed=stop"])
    assert load_config(None, ["train.mismatch.max_kl=null"]).train.mismatch.max_kl is None


def test_on_off_settings_take_yaml_booleans_and_words(tmp_path):
    # YAML 1.1 reads a bare on/off as true/false: the docs' `delta: on` must load.
    path = tmp_path / "delta.yaml"
    path.write_text("weights:\n  delta: on\n")
    assert load_config(str(path), {}).weights.delta == "on"
    for raw, want in (("on", "on"), ("off", "off"), ("true", "on"), ("false", "off")):
        assert load_config(None, [f"weights.delta={raw}"]).weights.delta == want
    with pytest.raises(ConfigError, match=r"weights.delta"):
        load_config(None, ["weights.delta=maybe"])
    path.write_text("train:\n  compile_layers: off\n")
    assert load_config(str(path), {}).train.compile_layers == "off"
    for raw, want in (("on", "on"), ("off", "off"), ("true", "on"), ("auto", "auto")):
        assert load_config(None, [f"train.compile_layers={raw}"]).train.compile_layers == want


def test_eval_sample_count_is_bounded_at_load():
    with pytest.raises(ConfigError, match=r"eval.n_samples.*less than or equal to 1024"):
        load_config(None, ["eval.n_samples=1000000000"])
