"""Rollout section of the run config."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str = Field("reverse", description="Builtin task name or a path to a JSONL file")
    input_key: str = Field("prompt", description="JSONL field with the prompt text")
    label_key: str = Field("label", description="JSONL field with the reference answer")
    reward: str = Field("match", description="Builtin reward name or module:function")
    batch_size: int = Field(16, ge=1, description="Prompts per iteration")
    n_samples_per_prompt: int = Field(8, ge=1, description="Group size for GRPO")
    max_new_tokens: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
