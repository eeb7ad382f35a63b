"""The loss section (``train.loss``): which policy loss and advantage estimator a run
trains with, their settings, and the correction for the gap between the engines'
logprobs and the trainer's. ``training.algorithm`` maps them onto the loss functions;
``training.config.TrainConfig`` holds the section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RolloutCorrectionConfig(BaseModel):
    """Correction for the gap between the engines' logprobs and the trainer's
    (``training.correction``): off by default. The ratio is exp(trainer - engine)
    per sampled token, the trainer's logprob taken at the step's start (no grad).
    Settings of a kind that is not chosen must stay at their defaults."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["none", "tis", "token_mis", "seq_mis", "geo_mask"] = Field(
        "none",
        description="none: no correction; tis: each token's loss times min(ratio, cap); "
        "token_mis: times the ratio, 0 where it leaves [low, high]; seq_mis: every token of a "
        "sequence times the sequence's ratio (product over its tokens), 0 where it leaves "
        "[low, high]; geo_mask: a sequence whose geometric-mean ratio leaves [low, high] gets "
        "no loss (SkyRL)",
    )
    cap: float = Field(
        2.0, ge=1, allow_inf_nan=False, description="tis: the largest weight a token gets"
    )
    low: float = Field(
        0.5, gt=0, lt=1, allow_inf_nan=False, description="masks: the band's lower end (< 1)"
    )
    high: float = Field(
        2.0, gt=1, allow_inf_nan=False, description="masks: the band's upper end (> 1)"
    )

    @model_validator(mode="after")
    def _check_kind(self) -> RolloutCorrectionConfig:
        users = {"cap": ("tis",), "low": _MASK_KINDS, "high": _MASK_KINDS}
        for name, kinds in users.items():
            if (
                self.kind not in kinds
                and getattr(self, name) != type(self).model_fields[name].default
            ):
                raise ValueError(
                    f"train.loss.rollout_correction.{name} only applies to kind: "
                    f"{' | '.join(kinds)}, but kind is {self.kind!r}; set the kind or remove {name}"
                )
        return self


_MASK_KINDS = ("token_mis", "seq_mis", "geo_mask")


class LossConfig(BaseModel):
    """Policy loss (``kind``) and advantage estimator (``advantage``), each chosen on
    its own; ``training.algorithm`` maps them onto the pure functions. Settings
    of a kind that is not chosen must stay at their defaults (no silent no-ops)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["grpo", "dr_grpo", "gspo", "dapo"] = Field(
        "grpo",
        description="grpo: token-level PPO-clip (clip_eps); dr_grpo: PPO-clip summed per "
        "sequence over a constant max_response_tokens; gspo: sequence-level ratio and clip "
        "(gspo_clip_eps_low/high); dapo: decoupled clip (clip_eps_low/high), token-level",
    )
    advantage: Literal[
        "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"
    ] = Field(
        "grpo",
        description="grpo: (r - group mean) / group std; dr_grpo: r - group mean; rloo: r "
        "minus the mean of the other samples of its prompt; reinforce_pp: r normalised over "
        "the batch; reinforce_pp_baseline: r - group mean, normalised by the batch std; "
        "gae: PPO, per-token GAE from the critic (train.critic)",
    )
    clip_eps: float = Field(0.2, gt=0, description="grpo / dr_grpo ratio clip: [1 - eps, 1 + eps]")
    clip_eps_low: float = Field(0.2, gt=0, lt=1, description="dapo lower clip: ratio >= 1 - this")
    clip_eps_high: float = Field(
        0.28, gt=0, description="dapo upper clip (clip-higher): ratio <= 1 + this"
    )
    gspo_clip_eps_low: float = Field(
        3e-4, gt=0, lt=1, description="gspo lower clip of the sequence ratio (paper: 3e-4)"
    )
    gspo_clip_eps_high: float = Field(
        4e-4, gt=0, description="gspo upper clip of the sequence ratio (paper: 4e-4)"
    )
    max_response_tokens: int | None = Field(
        None,
        ge=1,
        description="The generation budget, i.e. rollout.max_new_tokens: dr_grpo's constant "
        "per-sequence denominator and the L_max of the overlong penalty",
    )
    overlong_buffer: int | None = Field(
        None,
        ge=1,
        description="DAPO soft overlong penalty: reward falls linearly to -1 over the last N "
        "tokens before max_response_tokens; None disables it",
    )
    overlong_filter: bool = Field(
        False, description="DAPO overlong filtering: truncated samples get no loss"
    )
    kl_coef: float = Field(0.0, ge=0, description="k3 KL to the frozen reference; 0 disables it")
    entropy_coef: float = Field(
        0.0, ge=0, description="Entropy bonus: the loss minus this times the token entropy"
    )
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()

    @model_validator(mode="after")
    def _check_combination(self) -> LossConfig:
        unused = {
            "clip_eps_low": "dapo",
            "clip_eps_high": "dapo",
            "gspo_clip_eps_low": "gspo",
            "gspo_clip_eps_high": "gspo",
        }
        for name, kind in unused.items():
            # Compared with the default, not model_fields_set, so a dumped and
            # reloaded config (run.json) validates the same way.
            if self.kind != kind and getattr(self, name) != type(self).model_fields[name].default:
                raise ValueError(
                    f"train.loss.{name} only applies to kind: {kind}, but kind is "
                    f"{self.kind!r}; set kind: {kind} or remove {name}"
                )
        for low, high in (
            ("clip_eps_low", "clip_eps_high"),
            ("gspo_clip_eps_low", "gspo_clip_eps_high"),
        ):
            if getattr(self, high) < getattr(self, low):
                raise ValueError(
                    f"train.loss.{high} ({getattr(self, high)}) is below {low} "
                    f"({getattr(self, low)}); set {high} >= {low} (the paper widens the upper side)"
                )
        if self.kind == "dr_grpo" and self.max_response_tokens is None:
            raise ValueError(
                "train.loss.kind dr_grpo divides by a constant token budget; "
                "set train.loss.max_response_tokens to rollout.max_new_tokens"
            )
        if self.kind == "dr_grpo" and "advantage" not in self.model_fields_set:
            raise ValueError(
                "train.loss.kind dr_grpo with the default advantage (grpo) keeps the std "
                "normalisation Dr. GRPO removes; set train.loss.advantage: dr_grpo, or "
                "advantage: grpo explicitly to ablate it"
            )
        if self.advantage == "gae" and self.kind == "gspo":
            raise ValueError(
                "train.loss.advantage gae gives one advantage per token, but kind gspo weighs "
                "whole sequences; use kind grpo, dapo or dr_grpo with gae"
            )
        if self.kind == "gspo" and self.rollout_correction.kind in ("tis", "token_mis"):
            raise ValueError(
                f"train.loss.rollout_correction.kind {self.rollout_correction.kind} weighs each "
                "token, but kind gspo weighs whole sequences; use seq_mis or geo_mask with gspo"
            )
        if self.overlong_buffer is not None and (
            self.max_response_tokens is None or self.overlong_buffer > self.max_response_tokens
        ):
            raise ValueError(
                f"train.loss.overlong_buffer {self.overlong_buffer} needs max_response_tokens "
                f"(got {self.max_response_tokens}) at least as large; set max_response_tokens "
                "to rollout.max_new_tokens"
            )
        return self
