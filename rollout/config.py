"""Rollout section of the run config."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout.environments import BUILTIN_ENVIRONMENTS
from rollout.failures import FailureConfig
from rollout.remote_reward import RemoteRewardConfig, check_url, is_url
from rollout.rewards import load_reward

# Batches made ahead at most: each waits on storage until train[k] takes it.
MAX_STALENESS = 16
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
    max_new_tokens: int = Field(8, ge=1, description="Tokens generated per sample at most")
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature; the trainer scores the batch at it too"
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: 1 keeps every token")
    max_staleness: int = Field(
        0,
        ge=0,
        description="N: rollout k is generated on v(k-1-N) (v0 for k <= N), so iteration k "
        "makes rollout[k+N] beside train[k]; 0 is on-policy. Off-policy, the loss's "
        "importance ratio uses the engines' per-token logprobs",
    )
    partial: bool = Field(
        False,
        description="Partial rollouts: rollout[k+N] switches to v(k) once publish[k] is done; "
        "its first rollout.partial_chunk tokens come from v(k-1), the rest from v(k), and "
        "every token records its version (needs max_staleness >= 1)",
    )
    partial_chunk: int | None = Field(
        None,
        ge=1,
        description="Partial rollouts: tokens of each sample generated before the version "
        "switch (a function of the config, never of timing); None: half of max_new_tokens",
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
        if self.max_staleness > MAX_STALENESS:
            raise ValueError(
                f"rollout.max_staleness {self.max_staleness} is above {MAX_STALENESS}: batches "
                f"generated that many versions back teach little and all wait on storage; set "
                f"it to {MAX_STALENESS} or less"
            )
        _check_partial(self)
        return self

    @property
    def head_tokens(self) -> int:
        """Partial rollouts: tokens of each sample generated before the version switch."""
        return self.partial_chunk or max(self.max_new_tokens // 2, 1)


def _check_partial(cfg: RolloutConfig) -> None:
    """Partial rollouts switch versions inside a batch made ahead: refuse what has none."""
    if not cfg.partial:
        if cfg.partial_chunk is not None:
            raise ValueError(
                "rollout.partial_chunk is set but rollout.partial is false; "
                "set rollout.partial: true, or remove partial_chunk"
            )
        return
    if cfg.max_staleness == 0:
        raise ValueError(
            "rollout.partial: true switches versions inside a batch made ahead, and "
            "rollout.max_staleness: 0 makes none; set rollout.max_staleness >= 1"
        )
    if cfg.head_tokens >= cfg.max_new_tokens:
        raise ValueError(
            f"rollout.partial_chunk {cfg.head_tokens} leaves no token for the newer version "
            f"(rollout.max_new_tokens {cfg.max_new_tokens}); set it below max_new_tokens"
        )
    if cfg.environment != "none" or cfg.dynamic_sampling.enabled:
        raise ValueError(
            "rollout.partial works on single-turn batches without dynamic sampling; set "
            "rollout.environment: none and rollout.dynamic_sampling.enabled: false, or "
            "rollout.partial: false"
        )
