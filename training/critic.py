"""PPO's critic: a value model trained as its own Ray train group beside the policy.

Owns the critic's rank (``CriticActor``: value model, AdamW, GAE over the
persisted rollouts, the clipped value loss), where its state lives
(``training.critic_store``: ``critic/checkpoints/iter_k`` and
``critic/advantages/iter_k.safetensors`` under the run, fenced like the
policy's) and its group (``CriticGroup``: actors ``{run}/critic/{rank}``,
placement ``{run}/critic-pg``, the policy group's ``ensure_state``).

Order within iteration k: the critic's ``train(k)`` before the policy's. It
scores rollouts k with the values it holds (state k-1), writes the GAE
advantages once, then takes its own value step; the policy's ``train(k)``
(``train.loss.advantage: gae``) reads those advantages. A replay recomputes the
same advantages (same state, same rollouts) and keeps the ones written first.
What it leaves out: no per-token KL reward and no critic warm-up steps.
Never imports Prefect.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rollout.types import RolloutBatch
from training import backend_torch as bt
from training.actor import TrainActor, step_seed
from training.advantages import gae_advantages, outcome_token_rewards, whiten
from training.algorithm import shaped_rewards
from training.batch import TrainBatch, build_train_batch, rank_micro_batches, rank_slice
from training.config import TrainerSections
from training.critic_store import CriticStore
from training.group import TrainGroup
from training.losses import value_loss


class CriticActor(TrainActor):
    """One critic rank: the train actor's lifecycle, checkpoints and collectives,
    with a value model and a value step instead of the policy's."""

    def store(self, fence: int | None = None) -> CriticStore:
        if fence not in self._stores:
            self._stores[fence] = CriticStore(self.storage_cfg, self.run_name, fence=fence)
        return self._stores[fence]

    def init_from_base(self, model_path: str) -> int:
        n, critic = self.world_size, self.cfg.critic
        self.model = bt.build_value_model(
            model_path, self.model_cfg.dtype, self.device, n, seed=self.seed
        )
        self.optim = torch.optim.AdamW(
            self.model.parameters(),
            lr=critic.lr,
            weight_decay=self.cfg.weight_decay,
            foreach=False,  # one fixed per-parameter update order
        )
        pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        self.base_model_path = model_path
        self._iteration = 0
        return 0

    def train_step(self, k: int) -> dict[str, float]:
        """Advantages of rollouts k (written once), then one value step; needs state k - 1."""
        self._require_at(k - 1, f"critic train_step({k})")
        t0 = time.perf_counter()
        batch = self._rollouts(k, f"the critic's train({k})")
        # The group advantages build_train_batch computes are not used here.
        layout_cfg = self.cfg.loss.model_copy(update={"advantage": "grpo"})
        full = build_train_batch(batch, self.pad_id, layout_cfg)
        old_values = self._score(full)
        advantages, returns = self._gae(batch, full, old_values)
        if self.rank == 0:
            self.store().write_advantages(k, advantages)
        torch.manual_seed(step_seed(self.seed, k, self.rank))
        sums = self._value_step(full, old_values, returns)
        grad_norm = self._clip_grad_norm()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        self._iteration = k
        n = max(float(sums[3]), 1.0)
        mask = full.loss_mask
        return {
            "iteration": k,
            "vf_loss": float(sums[0]),
            "vf_clip_frac": float(sums[1]) / n,
            "value_mean": float((old_values * mask).sum() / mask.sum().clamp(min=1.0)),
            "return_mean": float((returns * mask).sum() / mask.sum().clamp(min=1.0)),
            "grad_norm": grad_norm,
            "response_tokens": int(n),
            "critic_s": time.perf_counter() - t0,
        }

    def _score(self, full: TrainBatch) -> torch.Tensor:
        """Values [B, T-1] of the whole batch under the current weights: each rank
        scores its own rows (the same micro-batch count on every rank, as FSDP's
        collectives pair up) and an all-gather gives every rank all of them."""
        dp, dp_rank = self._data_parallel_size(), self._data_parallel_rank()
        start, end = rank_slice(full.size, dp_rank, dp)
        mine = torch.zeros((end - start, full.loss_mask.shape[1]), device=self.device)
        self.model.eval()
        with torch.no_grad():
            row = 0
            for mb in rank_micro_batches(full, dp_rank, dp, self.cfg):
                mb = self._to_device(mb)
                v = bt.token_values(
                    self.model, mb.input_ids, mb.attention_mask, self.cfg.pack_sequences
                )
                mine[row : row + mb.size, : v.shape[1]] = v
                row += mb.size
        if dp > 1:
            import torch.distributed as dist

            parts = [torch.empty_like(mine) for _ in range(dp)]
            dist.all_gather(parts, mine)
            mine = torch.cat(parts)
        return mine.cpu() * full.loss_mask

    def _gae(
        self, batch: RolloutBatch, full: TrainBatch, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        critic = self.cfg.critic
        lengths = torch.tensor([len(s.response_ids) for s in batch.samples])
        rewards = shaped_rewards(self.cfg.loss, full.rewards, lengths)
        token_rewards = outcome_token_rewards(rewards, full.loss_mask)
        adv, ret = gae_advantages(
            token_rewards, values, full.loss_mask, critic.gamma, critic.gae_lambda
        )
        return (whiten(adv, full.loss_mask) if critic.whiten_advantages else adv), ret

    def _value_step(
        self, full: TrainBatch, old_values: torch.Tensor, returns: torch.Tensor
    ) -> torch.Tensor:
        """Forward/backward this rank's micro-batches; summed metrics, all-reduced."""
        dp, dp_rank = self._data_parallel_size(), self._data_parallel_rank()
        denom = max(full.num_tokens, 1) / dp
        start, _ = rank_slice(full.size, dp_rank, dp)
        clip = self.cfg.critic.value_clip_eps
        self.model.train()
        self.optim.zero_grad(set_to_none=True)
        sums = torch.zeros(4, dtype=torch.float64)  # [loss, clip_frac*n, vf_loss*n, n]
        row = start
        for mb in rank_micro_batches(full, dp_rank, dp, self.cfg):
            width = mb.loss_mask.shape[1]
            old = old_values[row : row + mb.size, :width]
            ret = returns[row : row + mb.size, :width]
            row += mb.size
            mb = self._to_device(mb)
            v = bt.token_values(
                self.model, mb.input_ids, mb.attention_mask, self.cfg.pack_sequences
            )
            loss, m = value_loss(
                v, old.to(v.device), ret.to(v.device), mb.loss_mask, clip, num_tokens=denom
            )
            loss.backward()
            n = float(mb.loss_mask.sum())
            sums += torch.tensor(
                [
                    float(loss.detach()) / dp,
                    float(m["vf_clip_frac"]) * n,
                    float(m["vf_loss"]) * n,
                    n,
                ],
                dtype=torch.float64,
            )
        return self._all_reduce_sums(sums)


RESOURCES = ("num_workers", "num_cpus_per_worker", "num_gpus_per_worker")


def critic_sections(sections: TrainerSections) -> TrainerSections:
    """What the critic's group is built from: the run's sections, with the rank
    resources ``train.critic`` sets in place of the policy's (``train.*``)."""
    critic = sections.train.critic
    own = {k: getattr(critic, k) for k in RESOURCES if getattr(critic, k) is not None}
    return sections.model_copy(update={"train": sections.train.model_copy(update=own)})


class CriticGroup(TrainGroup):
    """The critic's ranks, built and recovered like the policy's train group from
    the same ``RunIdentity`` and the critic's own sections (``critic_sections``)."""

    def _own_sections(self, sections: TrainerSections) -> TrainerSections:
        return critic_sections(sections)

    @property
    def pg_name(self) -> str:
        return f"{self.run_name}/critic-pg"

    def actor_name(self, rank: int) -> str:
        return f"{self.run_name}/critic/{rank}"

    def _actor_class(self) -> type[TrainActor]:
        if self.train_cfg.loss.advantage != "gae":
            raise ValueError(
                "a critic is trained for train.loss.advantage: gae only; set it to use PPO"
            )
        return CriticActor

    def _store(self) -> CriticStore:
        return CriticStore(self.storage_cfg, self.run_name)

    def export_hf(self, version: int, iteration: int, parent: int | None) -> Any:
        raise NotImplementedError("the critic is never published; engines serve the policy")
