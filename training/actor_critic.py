"""The trainer a run drives: the policy's train group, and with
``train.loss.advantage: gae`` (PPO) the critic's group beside it.

``train_group`` is the one place that chooses; ``ActorCriticGroup`` answers
every call the steps make of a trainer (``tasks.steps``, ``tasks.serving``,
``tasks.colocate``) by driving both groups, so the steps never know a critic
exists:

    ensure_state(k)   the critic's, then the policy's: each restores its own
                      newest committed checkpoint (critic/checkpoints, checkpoints)
                      and replays the persisted rollouts after it; the policy's
                      replay reads the advantages the critic wrote then
    train(k)          critic.train(k) (values -> GAE advantages, written once;
                      clipped value loss), then policy.train(k) on them
    save(k)           both, in the background alike; warnings of both
    offload / onload  both (colocated runs)
    release/shutdown  both

Publishing, pushes and the weights version are the policy's alone: engines
serve the policy. A fault's ``kill_actor`` at a train-side step kills rank 0
of ``actors()``, the critic's: the policy's own recovery is what the GRPO
fault matrix covers. Never imports Prefect.
"""

from __future__ import annotations

from typing import Any

from actors.placement import SharedPlacement
from training.config import RunIdentity, TrainerSections
from training.critic import CriticGroup
from training.group import TrainGroup


def train_group(
    identity: RunIdentity,
    sections: TrainerSections,
    *,
    placement: SharedPlacement | None,
    fence: int | None,
    call_timeout_s: float | None = None,
) -> TrainGroup | ActorCriticGroup:
    """The run's trainer: the policy's group, with the critic's when the advantage is gae."""
    policy = TrainGroup(
        identity, sections, placement=placement, fence=fence, call_timeout_s=call_timeout_s
    )
    if sections.train.loss.advantage != "gae":
        return policy
    # The critic takes devices of its own (RunConfig refuses gae with colocation).
    critic = CriticGroup(
        identity, sections, placement=None, fence=fence, call_timeout_s=call_timeout_s
    )
    return ActorCriticGroup(policy, critic)


class ActorCriticGroup:
    """The policy's and the critic's train groups, driven as one trainer."""

    def __init__(self, policy: TrainGroup, critic: CriticGroup) -> None:
        self.policy, self.critic = policy, critic
        # What callers read of a trainer: the policy's settings (the critic's are the same).
        self.identity, self.sections = policy.identity, policy.sections
        # Engines serve the policy: publishing it and pushing it are the policy group's alone.
        self.export_hf, self.push_weights = policy.export_hf, policy.push_weights

    @property
    def world_size(self) -> int:
        return self.policy.world_size

    def create(self, base_model_path: str) -> None:
        self.critic.create(base_model_path)
        self.policy.create(base_model_path)

    def actors(self) -> list[Any]:
        """The critic's ranks, then the policy's (fault injection kills the first)."""
        return [*self.critic.actors(), *self.policy.actors()]

    def iteration(self) -> int | None:
        """The policy's iteration (what a push or an export would send)."""
        return self.policy.iteration()

    def alive(self) -> bool:
        return self.critic.alive() and self.policy.alive()

    def ensure_state(self, k: int, base_model_path: str) -> dict[str, Any]:
        """Both groups hold state k (see the module docstring); the policy's report,
        with the critic's warnings and restore point added."""
        critic = self.critic.ensure_state(k, base_model_path)
        policy = self.policy.ensure_state(k, base_model_path)
        return {
            **policy,
            "critic_restored_from": critic["restored_from"],
            "warnings": [*critic["warnings"], *policy["warnings"]],
        }

    def train(self, k: int) -> dict[str, Any]:
        """The critic's step on rollouts k (it writes their advantages), then the policy's."""
        critic = self.critic.train(k)
        policy = self.policy.train(k)
        keep = ("vf_loss", "vf_clip_frac", "value_mean", "return_mean", "critic_s")
        return {**policy, **{key: critic[key] for key in keep}}

    def save(
        self,
        k: int,
        meta_extra: dict | None = None,
        background: bool = False,
        fail_background: bool = False,
    ) -> dict:
        critic = self.critic.save(k, meta_extra, background, fail_background) or {}
        policy = self.policy.save(k, meta_extra, background, fail_background) or {}
        warnings = [*(critic.get("warnings") or []), *(policy.get("warnings") or [])]
        return {**policy, "warnings": warnings}

    def wait_saved(self) -> list[str]:
        return [*self.critic.wait_saved(), *self.policy.wait_saved()]

    def offload(self) -> list[dict[str, Any]]:
        return [*self.critic.offload(), *self.policy.offload()]

    def onload(self) -> list[dict[str, Any]]:
        return [*self.critic.onload(), *self.policy.onload()]

    def release(self) -> None:
        self.critic.release()
        self.policy.release()

    def shutdown(self) -> None:
        self.critic.shutdown()
        self.policy.shutdown()
