"""Train section of the run config."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class LossConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["grpo"] = "grpo"
    clip_eps: float = Field(0.2, gt=0)
    kl_coef: float = Field(0.0, ge=0, description="k3 KL to the frozen reference; 0 disables it")
    entropy_coef: float = Field(0.0, ge=0)


class MegatronConfig(BaseModel):
    """Model-parallel sizes of ``train.backend: megatron``; data parallel is
    num_workers / (tensor_parallel * pipeline_parallel)."""

    model_config = ConfigDict(extra="forbid")

    tensor_parallel: int = Field(1, ge=1)
    pipeline_parallel: int = Field(1, ge=1)


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backend: Literal["torch", "megatron"] = "torch"
    num_workers: int = Field(
        1, ge=1, description="Train actors (ranks); FSDP2 over gloo/NCCL when > 1"
    )
    num_cpus_per_worker: float = Field(1.0, gt=0)
    num_gpus_per_worker: float = Field(0.0, ge=0)
    torch_threads: int = Field(1, ge=1)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    micro_batch_size: int = Field(64, ge=1)
    release_after_publish: bool = False
    loss: LossConfig = LossConfig()
    megatron: MegatronConfig = MegatronConfig()


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(
        None, description="Local HF checkpoint directory; None builds the tiny model offline"
    )
    dtype: Literal["float32", "bfloat16"] = "float32"


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
        512 * 1024 * 1024, ge=1024, description="Max bytes per safetensors shard"
    )
    publish_interval: int = Field(1, ge=1)
    flush_cache_interval: int = Field(1, ge=1, description="Flush engine caches every N versions")
