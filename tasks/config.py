"""RunConfig: the whole run's settings, composed from each package's own section.

It lives below ``flows/`` so that the runtime in ``tasks/`` can use it without
importing upward (``flows.config`` loads YAML and applies ``--set`` on top).
Unknown keys are rejected with the key named; validation never rewrites what
the user wrote. Imports no Prefect and no Ray: config parsing stays light.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engines.config import EngineConfig, PlacementConfig
from rollout.config import RolloutConfig
from rollout.evaluation import EvalConfig
from storage.config import StorageConfig
from tasks.tracking_config import TrackingConfig
from training.config import ModelConfig, TrainConfig, WeightsConfig, check_precision

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class RunSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("tiny-cpu", description="Run name: the folder under storage.root")
    iterations: int = Field(20, ge=0, description="Total RL iterations of the run")
    seed: int = Field(
        0,
        ge=0,
        description="Seed of the prompts, of every sample's sampling seed and of the trainer",
    )
    save_interval: int = Field(
        5, ge=1, description="Checkpoint every N iterations (and at the end)"
    )
    async_save: bool = Field(
        True,
        description="Write checkpoints in the background from a host copy while the run goes "
        "on (the last one, and every one with train.release_after_publish, before the step ends)",
    )

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
    namespace: str = Field(
        "prefect-rl", description="Ray namespace of the run's named actors and placement groups"
    )


class TaskPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    retries: int = Field(2, ge=0, description="Prefect retries of every step's task run")
    retry_delay_s: list[float] = Field(
        default_factory=lambda: [1.0, 2.0, 5.0],
        description="Seconds before each retry of a step (the last repeats for more retries)",
    )
    timeout_s: float = Field(
        1800.0,
        gt=0,
        description="A step waiting on an engine or a train rank longer than this fails, "
        "naming what it waited on, and is retried",
    )


# save_background: inside the background checkpoint write (exception: the write fails;
# kill_actor: train rank 0 dies while it writes; sigkill: the flow process dies meanwhile).
FaultStep = Literal[
    "rollout",
    "rollout_head",
    "train",
    "save",
    "save_background",
    "publish",
    "reload",
    "verify",
    "evaluate",
]


class FaultSpec(BaseModel):
    """Fault injection for tests: fail ``step`` at iteration ``iteration``."""

    model_config = ConfigDict(extra="forbid")

    step: FaultStep = Field(
        ..., description="The step (or the background checkpoint write) that fails"
    )
    iteration: int = Field(..., ge=1, description="The iteration whose step fails")
    kind: Literal["exception", "kill_actor", "sigkill"] = Field(
        "exception",
        description="exception: the step raises; kill_actor: a Ray actor it drives is killed; "
        "sigkill: the flow process is killed",
    )
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
    tracking: TrackingConfig = TrackingConfig()
    eval: EvalConfig = EvalConfig()  # evaluation during training (rollout.evaluation)
    faults: list[FaultSpec] = Field(
        default_factory=list, description="Fault injection (tests only)"
    )

    @model_validator(mode="after")
    def _sections_agree(self) -> RunConfig:
        if self.rollout.n_samples_per_prompt < 2:
            raise ValueError(
                "rollout.n_samples_per_prompt must be at least 2: GRPO normalises rewards "
                "within a group of samples of one prompt"
            )
        _check_no_credentials(self.storage.root)
        check_precision(self.train, self.model)
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
        critic_ranks = self.train.critic.num_workers  # PPO's critic: ranks of its own
        if critic_ranks and n_seq % critic_ranks:
            raise ValueError(
                f"rollout.batch_size * rollout.n_samples_per_prompt = {n_seq} must be divisible "
                f"by train.critic.num_workers = {critic_ranks}; change one of them"
            )
        if self.placement.colocate:
            _check_colocation(self)
        elif self.weights.transport == "distributed":
            _check_broadcast_devices(self)
        _check_node_pinning(self)
        _check_sglang_transport(self)
        if self.train.lora is not None:
            _check_lora_serving(self)
        return self

    @model_validator(mode="after")
    def _pipelining_needs_own_devices(self) -> RunConfig:
        if self.rollout.max_staleness and self.placement.colocate:
            raise ValueError(
                "rollout.max_staleness >= 1 overlaps generation with training, but with "
                "placement.colocate the engines and the trainer take turns on the same devices; "
                "set rollout.max_staleness: 0, or placement.colocate: false"
            )
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
    if cfg.train.loss.advantage == "gae":
        raise ValueError(
            "train.loss.advantage gae trains a critic beside the policy, and placement.colocate "
            "has no bundles for it; set placement.colocate: false for PPO"
        )
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


def _check_sglang_transport(cfg: RunConfig) -> None:
    """An SGLang server takes in-memory weights from GPU memory only (CUDA IPC, NCCL)."""
    if cfg.engines.kind != "sglang" or cfg.weights.transport not in ("tensor", "distributed"):
        return
    if cfg.train.num_gpus_per_worker <= 0 or cfg.engines.num_gpus_per_engine <= 0:
        raise ValueError(
            f"weights.transport {cfg.weights.transport!r} into engines.kind 'sglang' moves "
            "weights from GPU to GPU (CUDA IPC or NCCL), but train.num_gpus_per_worker="
            f"{cfg.train.num_gpus_per_worker:g} and engines.num_gpus_per_engine="
            f"{cfg.engines.num_gpus_per_engine:g}; give both GPUs, or use weights.transport: disk"
        )


def _check_lora_serving(cfg: RunConfig) -> None:
    """With train.lora every version after v0 is an adapter (``storage.adapters``):
    refuse the settings that cannot publish or serve one."""
    if cfg.weights.delta == "on":
        raise ValueError(
            "weights.delta: on stores versions as XOR deltas of full ones, but with train.lora "
            "every version is already only its adapters (a few MB); set weights.delta: off"
        )
    if cfg.weights.transport == "distributed":
        raise ValueError(
            "weights.transport 'distributed' broadcasts full weights, but with train.lora "
            "engines load adapters; use weights.transport: tensor, disk or object-store"
        )
    if cfg.engines.kind == "sglang" and cfg.rollout.environment != "none":
        raise ValueError(
            "multi-turn episodes (rollout.environment) call SGLang's /generate without naming "
            "the adapter version each turn samples from; with train.lora and engines.kind "
            "sglang set rollout.environment: none, or use engines.kind: embedded"
        )
    if cfg.engines.kind == "embedded" and cfg.engines.tp_size > 1:
        raise ValueError(
            "the embedded engine serves LoRA adapters on one rank, but engines.tp_size is "
            f"{cfg.engines.tp_size}; set engines.tp_size: 1, or remove train.lora"
        )


def _check_node_pinning(cfg: RunConfig) -> None:
    """Refuse sides pinned apart (engines.node_resource, train.node_resource) where
    they must share a host: colocated devices, or tensor's shared memory / CUDA IPC."""
    e, t = cfg.engines.node_resource, cfg.train.node_resource
    if e == t:
        return
    pins = f"engines.node_resource {e!r} and train.node_resource {t!r}"
    if cfg.placement.colocate:
        raise ValueError(
            f"placement.colocate puts train and engine ranks on the same devices, but {pins} "
            "may put them on different nodes; give both the same resource, or set "
            "placement.colocate: false"
        )
    if cfg.weights.transport == "tensor":
        raise ValueError(
            f"weights.transport 'tensor' hands buckets over one host's shared memory / CUDA "
            f"IPC, but {pins} may put the two sides on different hosts; use weights.transport: "
            "distributed (gloo / NCCL across nodes) or object-store, or pin both to one resource"
        )


def _check_broadcast_devices(cfg: RunConfig) -> None:
    """A broadcast group (trainer rank 0 + one engine's ranks) is an NCCL group on
    GPUs, and NCCL refuses two of its ranks on one GPU ("Duplicate GPU detected").
    Fractional GPUs that fit together on one device let Ray place them so."""
    t, e, tp = (
        cfg.train.num_gpus_per_worker,
        cfg.engines.num_gpus_per_engine,
        cfg.engines.tp_size,
    )
    eps = 1e-9  # 0.7 + 0.3 is not exactly 1.0 in floats
    shared = t > 0 and e > 0 and t + e <= 1 + eps
    own_ranks = cfg.engines.kind != "sglang" and tp > 1 and 0 < e and 2 * e <= 1 + eps
    if shared or own_ranks:
        who = (
            f"train.num_gpus_per_worker={t} and engines.num_gpus_per_engine={e} fit on one GPU"
            if shared
            else f"two of an engine's {tp} ranks fit on one GPU (engines.num_gpus_per_engine={e})"
        )
        raise ValueError(
            f"weights.transport 'distributed' broadcasts over NCCL, which refuses two ranks of "
            f"one group on one GPU, but {who}, so Ray may place them together; give every "
            "train rank and engine rank a whole GPU (num_gpus 1), or use weights.transport: "
            "tensor (CUDA IPC), which is made for actors sharing a GPU"
        )


class ConfigError(ValueError):
    """A config the user must fix; the message says how."""
