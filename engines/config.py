"""Engines section of the run config."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["embedded"] = "embedded"
    num_engines: int = Field(1, ge=1)
    num_cpus_per_engine: float = Field(1.0, gt=0, description="Ray CPUs reserved per engine")
    num_gpus_per_engine: float = Field(0.0, ge=0)
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads inside an engine")
    max_batch_size: int = Field(256, ge=1, description="Sequences decoded together")
    local_cache_dir: str | None = Field(
        None, description="Pull each version here before reloading (needed for remote storage)"
    )
    pause_mode: Literal["abort", "in_place"] = "in_place"
    health_timeout_s: float = Field(30.0, gt=0)
    batch_wait_s: float = Field(
        0.005, ge=0, description="How long a non-full batch waits for more requests to join"
    )
