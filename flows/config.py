"""RunConfig: the whole run's settings, composed from each package's own section.

Loaded from YAML, with ``--set a.b=c`` overrides. Unknown keys are rejected with
the key named; validation never rewrites what the user wrote.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engines.config import EngineConfig, PlacementConfig
from rollout.config import RolloutConfig
from rollout.rewards import BUILTIN_REWARDS
from storage.config import StorageConfig
from training.config import ModelConfig, TrainConfig, WeightsConfig

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class RunSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("tiny-cpu", description="Run name: the folder under storage.root")
    iterations: int = Field(20, ge=0, description="Total RL iterations of the run")
    seed: int = Field(0, ge=0)
    save_interval: int = Field(5, ge=1, description="Checkpoint every N iterations (and at the end)")

    @model_validator(mode="after")
    def _check_name(self) -> RunSection:
        if not _NAME_RE.match(self.name):
            raise ValueError(
                f"run.name {self.name!r} is not a valid run name: use letters, digits, '.', '_' "
                "or '-' (at most 64, starting with a letter or digit)"
            )
        return self


class RaySection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(None, description="Ray cluster address; None starts a local one")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local cluster (logical)")
    namespace: str = "prefect-rl"


class TaskPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    retries: int = Field(2, ge=0)
    retry_delay_s: list[float] = Field(default_factory=lambda: [1.0, 2.0, 5.0])
    timeout_s: float = Field(1800.0, gt=0)


FaultStep = Literal["rollout", "train", "save", "publish", "reload", "verify"]


class FaultSpec(BaseModel):
    """Fault injection for tests: fail ``step`` at iteration ``iteration``."""

    model_config = ConfigDict(extra="forbid")

    step: FaultStep
    iteration: int = Field(..., ge=1)
    kind: Literal["exception", "kill_actor", "sigkill"] = "exception"
    times: int = Field(1, ge=1, description="How many attempts fail before it heals")


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run: RunSection = RunSection()
    model: ModelConfig = ModelConfig()
    storage: StorageConfig = StorageConfig()
    engines: EngineConfig = EngineConfig()
    placement: PlacementConfig = PlacementConfig()
    train: TrainConfig = TrainConfig()
    rollout: RolloutConfig = RolloutConfig()
    weights: WeightsConfig = WeightsConfig()
    ray: RaySection = RaySection()
    tasks: TaskPolicy = TaskPolicy()
    faults: list[FaultSpec] = Field(default_factory=list, description="Fault injection (tests only)")

    @model_validator(mode="after")
    def _sections_agree(self) -> RunConfig:
        if self.rollout.n_samples_per_prompt < 2:
            raise ValueError(
                "rollout.n_samples_per_prompt must be at least 2: GRPO normalises rewards "
                "within a group of samples of one prompt"
            )
        _check_no_credentials(self.storage.root)
        remote = "://" in self.storage.root and not self.storage.root.startswith("file://")
        if self.weights.transport in ("disk", "tensor", "distributed") and remote:
            raise ValueError(
                f"weights.transport {self.weights.transport!r} needs a local storage.root, "
                f"got {self.storage.root!r}; "
                "set weights.transport: object-store to publish to object storage"
            )
        if self.weights.transport == "object-store" and not remote:
            raise ValueError(
                "weights.transport 'object-store' needs an object-store storage.root such as "
                "s3://bucket/prefix; use weights.transport: disk for a local path"
            )
        n_seq = self.rollout.batch_size * self.rollout.n_samples_per_prompt
        if n_seq % self.train.num_workers:
            raise ValueError(
                f"rollout.batch_size * rollout.n_samples_per_prompt = {n_seq} must be divisible "
                f"by train.num_workers = {self.train.num_workers}; change one of them"
            )
        if self.placement.colocate:
            _check_colocation(self)
        return self


def _check_no_credentials(root: str) -> None:
    """Refuse ``s3://key:secret@bucket`` at load, before the root reaches a flow
    run's parameters, run.json or a log. The message never repeats the URL."""
    proto, sep, rest = root.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        raise ValueError(
            f"storage.root ({proto}://...) contains credentials; remove them from the URL and set "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment instead"
        )


def _check_colocation(cfg: RunConfig) -> None:
    """Colocated ranks share one device per placement bundle; refuse what cannot."""
    t_gpus, e_gpus = cfg.train.num_gpus_per_worker, cfg.engines.num_gpus_per_engine
    if (t_gpus > 0) != (e_gpus > 0):
        raise ValueError(
            "placement.colocate shares devices between train ranks and engines: set both "
            "train.num_gpus_per_worker and engines.num_gpus_per_engine above 0 on GPUs "
            f"(e.g. 0.5 each), or both to 0 on CPU; got {t_gpus} and {e_gpus}"
        )
    if t_gpus + e_gpus > 1 + 1e-9:  # 0.7 + 0.3 is not exactly 1.0 in floats
        raise ValueError(
            f"train.num_gpus_per_worker + engines.num_gpus_per_engine = {t_gpus + e_gpus} > 1, "
            "but with placement.colocate a train rank and an engine rank share one GPU; "
            "lower them so they sum to at most 1 (e.g. 0.5 each)"
        )
    if t_gpus > 0 and cfg.weights.transport == "distributed":
        raise ValueError(
            "weights.transport 'distributed' cannot run colocated on GPUs: NCCL refuses two "
            "ranks on one GPU; use weights.transport: tensor (CUDA IPC) or disk, "
            "or set placement.colocate: false"
        )
    if cfg.engines.kind == "sglang":
        if cfg.engines.tp_size > 1:
            raise ValueError(
                "placement.colocate with engines.kind 'sglang' needs engines.tp_size: 1 (the "
                "server's TP processes cannot take one shared bundle each); "
                "set engines.tp_size: 1 or placement.colocate: false"
            )
        if "--enable-memory-saver" not in cfg.engines.sglang.extra_args:
            raise ValueError(
                "colocated SGLang engines free their memory only with --enable-memory-saver: "
                "add it to engines.sglang.extra_args"
            )


class ConfigError(ValueError):
    """A config the user must fix; the message says how."""


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {key!r} is not a section")
    node[keys[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """``a.b=c`` -> ("a.b", c) with c parsed as YAML (numbers, bools, null, lists)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set run.iterations=5")
    key, raw = item.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"  unknown key {loc!r}: remove it or check its spelling")
        else:
            lines.append(f"  {loc or '<root>'}: {e['msg']}")
    return "\n".join(lines)


def _rollout_value(data: dict[str, Any], key: str) -> Any:
    section = data.get("rollout")
    default = RolloutConfig.model_fields[key].get_default(call_default_factory=True)
    return section.get(key, default) if isinstance(section, dict) else default


def _check_code_unchanged(from_file: dict[str, Any], data: dict[str, Any]) -> None:
    """Overrides (``--set``, a deployment's ``overrides``) may not choose code to
    run: whoever can start a deployment can set them, while the config file is
    the operator's. So they cannot widen the trusted modules, nor name a reward
    outside the builtins that the file does not already name."""
    if _rollout_value(data, "trusted_reward_modules") != _rollout_value(from_file, "trusted_reward_modules"):
        raise ConfigError(
            "overrides cannot change rollout.trusted_reward_modules: which code a run may import is "
            "chosen in the config file; put it in the config file"
        )
    reward = _rollout_value(data, "reward")
    # A name without ':' is no code; the rollout section explains a typo there.
    named_code = isinstance(reward, str) and ":" in reward
    if named_code and reward != _rollout_value(from_file, "reward"):
        raise ConfigError(
            f"overrides cannot set rollout.reward to {reward!r}: only a builtin "
            f"({', '.join(BUILTIN_REWARDS)}) or the reward the config file names; "
            "put it in the config file (with its module under rollout.trusted_reward_modules)"
        )


def load_config(
    path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None
) -> RunConfig:
    """Load a RunConfig from YAML (or defaults) and apply overrides."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass a YAML file such as configs/tiny-cpu.yaml")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections at the top")
        source = str(p)
    items = list(overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides or []))
    from_file = copy.deepcopy(data)
    for key, value in items:
        _set_dotted(data, key, value)
    if items:
        _check_code_unchanged(from_file, data)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None
