"""The sections training owns (train, model, weights) and what a train group is built from.

``TrainGroup`` and every ``TrainActor`` receive exactly two settings objects:
a ``RunIdentity`` (run-level names, not a section) and ``TrainerSections`` (the
sections the trainer reads, whole). Both are required, so a caller cannot
forget a section and have the trainer fall back to its defaults.
"""

from __future__ import annotations

from typing import Annotated, Literal, Protocol

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from actors.resources import check_node_resource
from rollout.config import RolloutConfig
from storage.config import StorageConfig
from training.loss_config import LossConfig


def yaml_switch(v: object) -> object:
    """YAML 1.1 reads a bare on/off (as the docs write it) as true/false: back to the
    word, in files and in --set alike."""
    return ("on" if v else "off") if isinstance(v, bool) else v


Switch = BeforeValidator(yaml_switch)  # for every setting whose values include on and off


class MegatronConfig(BaseModel):
    """Model-parallel sizes of ``train.backend: megatron``; data parallel is
    num_workers / (tensor_parallel * pipeline_parallel)."""

    model_config = ConfigDict(extra="forbid")

    tensor_parallel: int = Field(1, ge=1, description="Megatron tensor-parallel size")
    pipeline_parallel: int = Field(1, ge=1, description="Megatron pipeline-parallel size")


class CriticConfig(BaseModel):
    """PPO's value model: its own train group, initialised from the policy's base
    weights with a fresh scalar head; used when ``train.loss.advantage`` is gae."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-3, gt=0, description="Critic learning rate (AdamW)")
    value_clip_eps: float | None = Field(
        0.2, gt=0, description="Clip the new value to old +- this in the loss; None: no clip"
    )
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    whiten_advantages: bool = Field(
        True, description="Normalise GAE advantages over the batch's response tokens"
    )
    # The critic's ranks: its own group's resources (training.critic.critic_sections).
    num_workers: int | None = Field(
        None, ge=1, description="Critic ranks (FSDP2 when > 1); None: train.num_workers"
    )
    num_cpus_per_worker: float | None = Field(
        None, gt=0, description="CPUs per critic rank; None: train.num_cpus_per_worker"
    )
    num_gpus_per_worker: float | None = Field(
        None, ge=0, description="GPUs per critic rank; None: train.num_gpus_per_worker"
    )


class MismatchConfig(BaseModel):
    """The gate on the gap between the engines' logprobs and the trainer's
    (``rollout_logprob_kl``), read where the trainer holds the very weights that
    made the batch (every iteration on-policy, the first one off-policy): there the
    gap is not learning but a difference in how the two score one model."""

    model_config = ConfigDict(extra="forbid")

    max_kl: float | None = Field(
        0.01,
        gt=0,
        allow_inf_nan=False,
        description="The largest rollout_logprob_kl a batch made by the trainer's own "
        "weights may show (a bf16 engine beside a bf16-compute trainer: about 1e-3); "
        "None: no gate",
    )
    on_exceed: Literal["warn", "error"] = Field(
        "warn",
        description="warn: one WARNING per run naming the usual causes, and the row's "
        "rollout_logprob_kl_over; error: train[k] fails before its optimizer step",
    )


class LoraConfig(BaseModel):
    """LoRA adapters trained in place of the full model (``training.lora``); the
    engines are sent the merged weights."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(16, ge=1, le=1024, description="The adapters' rank r")
    alpha: float = Field(
        32.0, gt=0, allow_inf_nan=False, description="Scale of the update: alpha / rank"
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        description="Last name part of each linear layer to adapt (Llama and Qwen: q_proj, "
        "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj); a name the model lacks "
        "is refused at start with the model's linear layers named",
    )

    @field_validator("target_modules")
    @classmethod
    def _plain_names(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if not m or "." in m or m != m.strip()]
        if bad or len(set(v)) != len(v):
            raise ValueError(
                f"train.lora.target_modules {v!r}: give each module's last name part once "
                "(e.g. q_proj), not a dotted path"
            )
        return v


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backend: Literal["torch", "megatron"] = Field(
        "torch",
        description="torch: FSDP2 when num_workers > 1; megatron: megatron-core (GPU, the "
        "megatron extra)",
    )
    num_workers: int = Field(
        1, ge=1, description="Train actors (ranks); FSDP2 over gloo/NCCL when > 1"
    )
    num_cpus_per_worker: float = Field(1.0, gt=0, description="Ray CPUs reserved per train rank")
    num_gpus_per_worker: float = Field(
        0.0, ge=0, description="Ray GPUs reserved per train rank (fractional: shares a GPU)"
    )
    node_resource: str | None = Field(
        None,
        description="Pin train ranks to the nodes offering this custom Ray resource (ray "
        "start --resources='{\"train_host\": 1}'); each rank's bundle asks for 0.001 of it. "
        "None: any node",
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads of each train rank")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="Clip the gradient norm to this")
    micro_batch_size: int = Field(64, ge=1, description="Max samples per micro-batch")
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=2,
        description="Cut micro-batches by a token budget as well (padded rows x longest, or "
        "the sum of lengths when packed); a longer sample runs alone. None: rows only",
    )
    pack_sequences: bool = Field(
        False,
        description="Run each micro-batch as one row of its samples without padding "
        "(position ids restart per sample, block-diagonal causal mask); torch backend only. "
        "Needs max_tokens_per_micro_batch: sdpa builds the row's mask, tokens^2 in size",
    )
    compute_dtype: Literal["float32", "bfloat16"] | None = Field(
        None,
        description="The dtype of the forward and backward passes; master weights and the "
        "optimizer state stay in model.dtype. bfloat16 over float32 weights: one rank runs "
        "on a bf16 copy of the master weights, cast once per step (the same bf16 weights an "
        "engine serving bf16 gets), gradients added into the fp32 master; several ranks "
        "use FSDP2 mixed precision (gradients reduced in fp32); megatron ranks each run a "
        "bf16 twin model beside their fp32 shard (gradients reduced in fp32). None: model.dtype",
    )
    logprob_kernel: Literal["auto", "eager", "compiled"] = Field(
        "auto",
        description="How the trainer computes log-softmax, logprobs and entropy over each "
        "chunk of output logits: eager (ATen ops), compiled (the same formulas through "
        "torch.compile, fused kernels on CUDA, a one-time compile of tens of seconds) or "
        "auto (compiled on CUDA with Triton installed, else eager); the two agree to "
        "float32 rounding",
    )
    compile_layers: Annotated[Literal["auto", "on", "off"], Switch] = Field(
        "auto",
        description="torch.compile each decoder layer of the trained and reference models "
        "(fused elementwise kernels: fewer launches, so less host time per token): on, off, "
        "or auto (on for one CUDA rank with Triton installed; off on CPU, where the eager "
        "model is the reference and compiling takes minutes, for FSDP2's ranks, where it "
        "has not been measured, and for LoRA, whose compiled layers scored SGLang's samples "
        "further off than eager ones on an H100). A one-time compile of tens of seconds "
        "at each trainer start; torch backend only (auto leaves megatron's layers as they "
        "are). On one H100, bf16 compute: a train step 1.11x faster at the 0.5B shape, "
        "1.42x at SmolLM2's (bench.train)",
    )
    release_after_publish: bool = Field(
        False,
        description="After each publish, end the train ranks and free their devices; every "
        "iteration is checkpointed (written before its step ends) and the ranks restored from it",
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train LoRA adapters (rank, alpha, dropout, target_modules) instead of "
        "every weight: only the adapters in the optimizer, the reference model for KL is the "
        "base with the adapters off; every version after v0 is an adapter of v0 (peft's "
        "files), which engines apply to the base they keep. None: full fine-tuning",
    )
    mismatch: MismatchConfig = MismatchConfig()
    loss: LossConfig = LossConfig()
    critic: CriticConfig = CriticConfig()
    megatron: MegatronConfig = MegatronConfig()

    @field_validator("compute_dtype", mode="before")
    @classmethod
    def _no_float16(cls, v: object) -> object:
        if v in ("float16", "fp16", "half"):
            raise ValueError(
                f"train.compute_dtype {v!r}: float16 needs loss scaling, which the trainer "
                "does not do; use bfloat16 (same speed on GPUs that have it, no scaling)"
            )
        return v

    @field_validator("node_resource")
    @classmethod
    def _custom_resource(cls, v: str | None) -> str | None:
        return check_node_resource("train.node_resource", v)

    @model_validator(mode="after")
    def _check_combination(self) -> TrainConfig:
        if self.loss.advantage == "gae" and self.backend != "torch":
            raise ValueError(
                "train.loss.advantage gae trains a critic, which only the torch backend has; "
                "set backend: torch or choose another advantage"
            )
        if self.loss.advantage != "gae" and self.critic != CriticConfig():
            raise ValueError(
                "train.critic is only used by train.loss.advantage: gae (PPO); set it or "
                "remove train.critic"
            )
        if self.lora is not None and self.backend != "torch":
            raise ValueError(
                f"train.lora needs backend: torch (peft adapters; the {self.backend} backend "
                "trains every weight); set backend: torch or remove train.lora"
            )
        if self.compile_layers == "on" and self.backend != "torch":
            raise ValueError(
                f"train.compile_layers: on needs backend: torch (the {self.backend} backend "
                "builds its own layers); set compile_layers: auto or off"
            )
        if self.pack_sequences and self.backend != "torch":
            raise ValueError(
                f"train.pack_sequences needs backend: torch (the {self.backend} backend runs "
                "padded rows); set pack_sequences: false or backend: torch"
            )
        if self.pack_sequences and self.max_tokens_per_micro_batch is None:
            # Measured on an H200 (bf16, 8-layer Llama, 64 samples of 64-1024 tokens): one
            # packed row per 64 samples ran 2.4x slower than padded rows; 8192-token packed
            # rows ran as fast as padded ones with sdpa, 10% faster with flex_attention.
            raise ValueError(
                "train.pack_sequences puts a whole micro-batch in one row, whose attention "
                "mask grows with the square of its tokens; set train.max_tokens_per_micro_batch "
                "(e.g. 8192) to bound the row"
            )
        return self


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(
        None, description="Local HF checkpoint directory; None builds the tiny model offline"
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="dtype of the master weights and the AdamW state (and of published versions)",
    )
    warm_start: Literal["none", "calculator"] = Field(
        "none",
        description="The tiny model only (path unset): calculator: a few hundred supervised "
        "steps on calculator demonstrations built offline (rollout.tools.demonstrations: "
        "a few show the call, most how to read its result or answer directly) before RL",
    )

    @model_validator(mode="after")
    def _check_warm_start(self) -> ModelConfig:
        if self.warm_start != "none" and self.path:
            raise ValueError(
                f"model.warm_start {self.warm_start!r} builds the tiny model, but model.path is "
                "set; unset model.path, or set model.warm_start: none"
            )
        return self


class WeightsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    transport: Literal["disk", "object-store", "tensor", "distributed"] = Field(
        "disk",
        description="disk: engines load version folders on a shared local disk; "
        "object-store: versions go to s3:// and each engine host pulls them to its local cache; "
        "tensor: trainer rank 0 hands buckets to same-host engines (shared memory / CUDA IPC); "
        "distributed: trainer rank 0 broadcasts buckets to each engine (gloo / NCCL). "
        "The in-memory transports still publish to disk every publish_interval for recovery",
    )
    bucket_bytes: int = Field(
        512 * 1024 * 1024, ge=1024, description="Max bytes per bucket of the in-memory transports"
    )
    shard_size: int = Field(
        128 * 1024 * 1024,
        ge=1024,
        description="Max bytes per safetensors shard. A shard's sha256 is one sequential "
        "pass and shards are written one per core (2 to 8 at once), so smaller shards "
        "spread a version's hashing: 128 MiB puts a 0.5B bf16 model in 8 files",
    )
    publish_interval: int = Field(
        1,
        ge=1,
        description="Publish a durable version every N iterations (and the last); disk "
        "transports reload from it, in-memory ones push every version regardless",
    )
    flush_cache_interval: int = Field(1, ge=1, description="Flush engine caches every N versions")
    delta: Annotated[Literal["off", "on"], Switch] = Field(
        "off",
        description="on: a published version is stored as the XOR of its bytes against the "
        "newest full version (zstd-compressed, storage.delta); readers rebuild and verify it",
    )
    full_every: int = Field(
        10,
        ge=1,
        description="With delta on: a version is written full when no full version is fewer "
        "than full_every versions older (1: every version full)",
    )
    base_cache_dir: str | None = Field(
        None,
        description="With delta on and an s3:// root: where the publisher keeps its verified "
        "copy of the full base it XORs against (pulled once per base); None: "
        "~/.cache/prefect-rl/{run}/weights, the engines' default cache",
    )


def check_precision(train: TrainConfig, model: ModelConfig) -> None:
    """``train.compute_dtype`` against ``model.dtype`` and the backend (ValueError)."""
    if train.compute_dtype == "float32" and model.dtype == "bfloat16":
        raise ValueError(
            "train.compute_dtype float32 over model.dtype bfloat16 computes in fp32 from "
            "weights and updates rounded to bf16; set model.dtype: float32 (fp32 master "
            "weights) or train.compute_dtype: bfloat16"
        )


class RunIdentity(BaseModel):
    """Who the trainer works for: run name (storage folder and actor names), seed
    and the Ray namespace its named actors live in."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    seed: int
    namespace: str


class _HasTrainerSections(Protocol):
    # RunConfig satisfies this; training does not import flows (it sits below them).
    train: TrainConfig
    model: ModelConfig
    storage: StorageConfig
    weights: WeightsConfig
    rollout: RolloutConfig


class TrainerSections(BaseModel):
    """Every config section the train group and its actors read, passed whole to
    each rank (it pickles), so a key the user sets always reaches the trainer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    train: TrainConfig
    model: ModelConfig
    storage: StorageConfig
    weights: WeightsConfig
    # max_staleness: whose logprobs the importance ratio divides by (``of`` always passes it)
    rollout: RolloutConfig = RolloutConfig()

    @model_validator(mode="after")
    def _check_precision(self) -> TrainerSections:
        check_precision(self.train, self.model)
        return self

    @property
    def compute_dtype(self) -> str:
        """The dtype the forward and backward run in."""
        return self.train.compute_dtype or self.model.dtype

    @classmethod
    def of(cls, run_cfg: _HasTrainerSections) -> TrainerSections:
        """The trainer's sections of a ``RunConfig`` (one call, nothing left out)."""
        return cls(**{name: getattr(run_cfg, name) for name in cls.model_fields})
