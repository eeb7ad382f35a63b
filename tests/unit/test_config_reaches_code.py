"""Every key of the trainer's config sections reaches the code that reads it.

A key the user sets but the trainer never receives is a silent bug: the run
goes on with the default. Each leaf key of ``train``, ``model``, ``weights``,
``tracking`` and ``eval`` is classified here: read by the trainer (code under training/ reads it, and a
non-default value set through ``--set`` arrives in what ``RunContext.trainer()``
hands its ranks), read by another module (named, and that module must read
it), or a key with one allowed value. A new key fails ``test_every_key_is_classified`` until it is
put in one of the three.
"""

from __future__ import annotations

import functools
import pickle
import re
import typing
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from flows.config import ConfigError, RunConfig, load_config
from storage.run_store import RunStore
from tasks.context import RunContext

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("train", "model", "weights", "tracking", "eval")

# Read by the train group or its actors (somewhere under training/): they
# arrive as part of the whole sections every rank receives.
TRAINER_KEYS = {
    "train.backend",
    "train.num_workers",
    "train.num_cpus_per_worker",
    "train.num_gpus_per_worker",
    "train.node_resource",
    "train.torch_threads",
    "train.lr",
    "train.weight_decay",
    "train.grad_clip",
    "train.micro_batch_size",
    "train.max_tokens_per_micro_batch",
    "train.pack_sequences",
    "train.compute_dtype",
    "train.logprob_kernel",
    "train.compile_layers",
    "train.lora",
    "train.mismatch.max_kl",
    "train.mismatch.on_exceed",
    "train.loss.kind",
    "train.loss.advantage",
    "train.loss.clip_eps",
    "train.loss.clip_eps_low",
    "train.loss.clip_eps_high",
    "train.loss.gspo_clip_eps_low",
    "train.loss.gspo_clip_eps_high",
    "train.loss.max_response_tokens",
    "train.loss.overlong_buffer",
    "train.loss.overlong_filter",
    "train.loss.kl_coef",
    "train.loss.entropy_coef",
    "train.loss.rollout_correction.kind",
    "train.loss.rollout_correction.cap",
    "train.loss.rollout_correction.low",
    "train.loss.rollout_correction.high",
    "train.critic.lr",
    "train.critic.value_clip_eps",
    "train.critic.gamma",
    "train.critic.gae_lambda",
    "train.critic.whiten_advantages",
    "train.critic.num_workers",
    "train.critic.num_cpus_per_worker",
    "train.critic.num_gpus_per_worker",
    "train.megatron.tensor_parallel",
    "train.megatron.pipeline_parallel",
    "model.dtype",
    "weights.shard_size",
    "weights.delta",  # training/durable.py: the publisher's writer
    "weights.full_every",
    "weights.base_cache_dir",
}
# Not read by the trainer: the orchestration layer reads them from ctx.cfg.
ELSEWHERE = {
    "train.release_after_publish": "tasks/steps.py",
    "model.path": "tasks/prepare.py",  # resolved once into RunContext.base_model_path
    "model.warm_start": "tasks/prepare.py",  # builds the tiny base RunContext points at
    "weights.transport": "tasks/serving/transports.py",  # passed to TrainGroup.push_weights
    "weights.bucket_bytes": "tasks/serving/engine.py",  # passed to TrainGroup.push_weights
    "weights.publish_interval": "tasks/steps.py",
    "weights.flush_cache_interval": "tasks/serving/engine.py",
    # tracking.*: the tracker module reads them when the finish step logs a row.
    "tracking.tensorboard.enabled": "tasks/tracking.py",
    "tracking.tensorboard.log_dir": "tasks/tracking.py",
    "tracking.mlflow.enabled": "tasks/tracking.py",
    "tracking.mlflow.tracking_uri": "tasks/tracking.py",
    "tracking.mlflow.experiment": "tasks/tracking.py",
    "tracking.wandb.enabled": "tasks/tracking.py",
    "tracking.wandb.project": "tasks/tracking.py",
    "tracking.wandb.dir": "tasks/tracking.py",
    # eval.*: the evaluate step (tasks/evaluation/step.py) hands the section to its scorer.
    "eval.interval": "rollout/evaluation.py",
    "eval.dataset": "rollout/evaluation.py",
    "eval.size": "rollout/evaluation.py",
    "eval.n_samples": "rollout/evaluation.py",
    "eval.pass_threshold": "rollout/evaluation.py",
    "eval.before_training": "rollout/evaluation.py",
}
# One allowed value: nothing to carry until a second one is added.
ONE_CHOICE: set[str] = set()
CRITIC_LEAVES = (
    "lr",
    "value_clip_eps",
    "gamma",
    "gae_lambda",
    "whiten_advantages",
    "num_workers",
    "num_cpus_per_worker",
    "num_gpus_per_worker",
)
# Keys whose non-default values are valid only with other settings (the
# section's validators refuse settings of a loss kind that is not chosen).
REQUIRES: dict[str, dict[str, Any]] = {
    "train.loss.clip_eps_low": {"train.loss.kind": "dapo"},
    "train.loss.clip_eps_high": {"train.loss.kind": "dapo"},
    "train.loss.gspo_clip_eps_low": {"train.loss.kind": "gspo"},
    "train.loss.gspo_clip_eps_high": {"train.loss.kind": "gspo"},
    "train.loss.overlong_buffer": {"train.loss.max_response_tokens": 64},
    "train.loss.rollout_correction.cap": {"train.loss.rollout_correction.kind": "tis"},
    "train.loss.rollout_correction.low": {"train.loss.rollout_correction.kind": "geo_mask"},
    "train.loss.rollout_correction.high": {"train.loss.rollout_correction.kind": "geo_mask"},
    "train.pack_sequences": {"train.max_tokens_per_micro_batch": 64},
    **{f"train.critic.{k}": {"train.loss.advantage": "gae"} for k in CRITIC_LEAVES},
}


def leaf_fields(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, FieldInfo]]:
    for name, f in model.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            yield from leaf_fields(f.annotation, f"{prefix}.{name}")
        else:
            yield f"{prefix}.{name}", f


def schema_keys() -> dict[str, FieldInfo]:
    return {
        key: f
        for section in SECTIONS
        for key, f in leaf_fields(RunConfig.model_fields[section].annotation, section)
    }


def candidates(f: FieldInfo) -> list[Any]:
    """Values other than the default, in the order tried."""
    ann, default = f.annotation, f.default
    literal = [a for a in typing.get_args(ann) if typing.get_origin(a) is typing.Literal]
    if typing.get_origin(ann) is typing.Literal:
        values = list(typing.get_args(ann))
    elif literal:  # Literal[...] | None
        values = list(typing.get_args(literal[0]))
    elif ann is bool:
        values = [not default]
    elif any(isinstance(a, type) and issubclass(a, BaseModel) for a in typing.get_args(ann)):
        values = [{"rank": 4}]  # an optional section (train.lora): set, with one key
    elif ann is int:
        values = [default + 1, default * 2]
    elif ann is float:
        values = [default + 0.5, default * 2, default / 2]
    elif int in typing.get_args(ann):  # int | None
        values = [64]
    elif float in typing.get_args(ann):  # float | None
        values = [0.5]
    elif str in typing.get_args(ann) or ann is str:
        values = ["/nonexistent/prefect-rl-walk"]
    else:
        raise AssertionError(f"no candidate values for a field of type {ann}")
    return [v for v in values if v != default]


def non_default_config(key: str, f: FieldInfo) -> tuple[RunConfig, Any]:
    """A valid RunConfig, loaded the way ``--set key=value`` is, with ``key`` changed."""
    for value in candidates(f):
        try:
            return load_config(None, {**REQUIRES.get(key, {}), key: value}), value
        except ConfigError:
            continue  # e.g. object-store needs an s3:// root; try the next value
    raise AssertionError(f"no valid non-default value for {key} among {candidates(f)}")


def test_every_key_is_classified():
    keys = set(schema_keys())
    classified = [*TRAINER_KEYS, *ELSEWHERE, *ONE_CHOICE]
    assert len(classified) == len(set(classified)), "a key is classified twice"
    assert keys - set(classified) == set(), "new keys: add them to TRAINER_KEYS or ELSEWHERE"
    assert set(classified) - keys == set(), "stale keys: remove them here"
    for key in ONE_CHOICE:
        assert candidates(schema_keys()[key]) == [], f"{key} has a second value now: classify it"


def _reads(path: Path, leaf: str) -> bool:
    return re.search(rf"\.{leaf}\b", path.read_text()) is not None


@pytest.mark.parametrize("key", sorted(TRAINER_KEYS))
def test_training_code_reads_the_key(key):
    """Arriving is not enough: some code under training/ (not the schema) reads it."""
    leaf = key.rsplit(".", 1)[1]
    files = [p for p in (ROOT / "training").rglob("*.py") if p.name != "config.py"]
    assert any(_reads(p, leaf) for p in files), f"nothing under training/ reads {key}"


@pytest.mark.parametrize("key", sorted(ELSEWHERE))
def test_named_module_reads_the_key(key):
    module = ELSEWHERE[key]
    assert _reads(ROOT / module, key.rsplit(".", 1)[1]), f"{module} does not read {key}"


# rollout.* is not walked whole yet; these keys name the module that reads them.
ROLLOUT_KEYS = {
    "rollout.max_staleness": "tasks/rollouts/versions.py",
    "rollout.partial": "tasks/rollouts/versions.py",
    "rollout.partial_chunk": "rollout/config.py",  # RolloutConfig.head_tokens, read by rollout/partial.py
}


@pytest.mark.parametrize("key", sorted(ROLLOUT_KEYS))
def test_rollout_key_is_read(key):
    module = ROLLOUT_KEYS[key]
    assert _reads(ROOT / module, key.rsplit(".", 1)[1]), f"{module} does not read {key}"
    assert key.split(".")[1] in RunConfig.model_fields["rollout"].annotation.model_fields


@pytest.mark.parametrize("key", sorted(TRAINER_KEYS))
def test_trainer_key_reaches_the_ranks(key):
    """Set through the real config path, the value is in the sections the group
    hands every rank, also after the pickling that Ray and Prefect do."""
    cfg, value = non_default_config(key, schema_keys()[key])
    trainer = pickle.loads(pickle.dumps(RunContext(cfg, base_model_path="unused").trainer()))
    got = functools.reduce(getattr, key.split("."), trainer.sections)
    if isinstance(got, BaseModel):  # an optional section, given as a mapping
        got = got.model_dump(exclude_defaults=True)
    assert got == value != schema_keys()[key].default


def test_run_identity_reaches_the_trainer():
    cfg = load_config(None, {"run.name": "ident", "run.seed": 11, "ray.namespace": "ns-x"})
    trainer = RunContext(cfg, base_model_path="unused").trainer()
    assert (trainer.identity.name, trainer.identity.seed, trainer.identity.namespace) == (
        "ident",
        11,
        "ns-x",
    )
    assert trainer.sections.storage == cfg.storage


def test_shard_size_changes_the_shards_a_real_export_writes(ray_cluster, tiny_model_dir, tmp_path):
    """A real CPU train actor built as a run builds it: the default shard size
    writes one shard of the tiny model, a small one splits it."""

    def export(shard_size: int | None) -> list[str]:
        sets = {"storage.root": str(tmp_path), "run.name": f"shards-{uuid.uuid4().hex[:6]}"}
        if shard_size is not None:
            sets["weights.shard_size"] = shard_size
        cfg = load_config(None, sets)
        trainer = RunContext(cfg, base_model_path=tiny_model_dir).trainer()
        try:
            trainer.create(tiny_model_dir)
            trainer.export_hf(1, 0, None)
        finally:
            trainer.shutdown()
        manifest = RunStore(cfg.storage, cfg.run.name).read_manifest(1)
        return [f.name for f in manifest.files if f.name.endswith(".safetensors")]

    assert export(None) == ["model.safetensors"]
    small = export(64 * 1024)
    assert len(small) > 1 and all(n.startswith("model-") for n in small)
