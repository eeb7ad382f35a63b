"""Rollout section of the run config."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout.environments import BUILTIN_ENVIRONMENTS
from rollout.failures import FailureConfig
from rollout.remote_reward import RemoteRewardConfig, check_url, is_url
from rollout.rewards import load_reward

_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class DynamicSamplingConfig(BaseModel):
    """``rollout.dynamic_sampling``: drop groups of equal rewards, generate more."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Drop groups whose rewards are all equal (DAPO)")
    max_rounds: int = Field(
        4,
        ge=1,
        le=64,
        description="Generation rounds per batch, the first included; a batch still short "
        "after them is filled with dropped groups",
    )


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str = Field(
        "reverse", description="Builtin task name or a path to a .jsonl or .parquet file"
    )
    input_key: str = Field(
        "prompt", description="Dataset field with the prompt text (a.b reaches a nested field)"
    )
    label_key: str = Field(
        "label", description="Dataset field with the reference answer (a.b reaches a nested field)"
    )
    chat_template: bool = Field(
        False,
        description="Send each prompt as the user turn of the tokenizer's chat template "
        "(with the generation prompt); a tokenizer without one is refused",
    )
    reward: str = Field(
        "match",
        description="Builtin reward name, module:function, or a reward server's http(s) URL",
    )
    remote_reward: RemoteRewardConfig = Field(
        default_factory=RemoteRewardConfig, description="How a reward server URL is called"
    )
    reward_workers: int = Field(
        0,
        ge=0,
        description="Ray tasks that score a batch's samples in parallel (a slow verifier or a "
        "reward server); 0: scored in the rollout step's process",
    )
    trusted_reward_modules: list[str] = Field(
        default_factory=list,
        description="Modules (or packages) rollout.reward may import from; only the config file may set it",
    )
    batch_size: int = Field(16, ge=1, description="Prompts per iteration")
    n_samples_per_prompt: int = Field(8, ge=1, description="Group size for GRPO")
    max_new_tokens: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_staleness: int = Field(
        0,
        ge=0,
        le=1,
        description="0: on-policy (rollout k on v(k-1)); 1: rollout k+1 on v(k-1) runs beside "
        "train[k], and the loss's importance ratio uses the engines' logprobs",
    )
    environment: str = Field(
        "none",
        description="Multi-turn episodes in this builtin environment (calculator); none: one "
        "completion per sample",
    )
    max_turns: int = Field(
        3, ge=1, le=64, description="Model turns per episode at most (multi-turn only)"
    )
    failures: FailureConfig = Field(
        default_factory=FailureConfig,
        description="Multi-turn: each prompt's failure budget, spares, the stall watchdog",
    )
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=DynamicSamplingConfig,
        description="DAPO dynamic sampling: drop groups of equal rewards, generate more prompts",
    )

    @model_validator(mode="after")
    def _check_reward(self) -> RolloutConfig:
        for name in self.trusted_reward_modules:
            if not _MODULE_RE.match(name):
                raise ValueError(
                    f"rollout.trusted_reward_modules entry {name!r} is not a module name; "
                    "give dotted module or package names such as mypkg.rewards"
                )
        # Resolved at load, so a bad reward is refused before any run state exists.
        if is_url(self.reward):
            check_url(self.reward)
        else:
            load_reward(self.reward, self.trusted_reward_modules)
        if self.environment != "none" and self.environment not in BUILTIN_ENVIRONMENTS:
            raise ValueError(
                f"rollout.environment {self.environment!r} is not a builtin "
                f"({', '.join(BUILTIN_ENVIRONMENTS)}); give one of those, or none"
            )
        return self
