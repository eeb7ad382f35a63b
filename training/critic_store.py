"""Where PPO's critic keeps its state, and what the policy reads of it.

``CriticStore``: the run store with the critic's checkpoints under ``critic/`` and
rollout k's GAE advantages, written once, at ``critic/advantages/iter_k``.
``policy_advantages``: what the policy's ``train(k)`` takes from there. Storage
only: the train actors of both sides import it, and it imports neither.
"""

from __future__ import annotations

import safetensors.torch
import torch

from storage.config import StorageConfig
from storage.fs import read_bytes, write_bytes
from storage.layout import iter_name
from storage.retention import gc
from storage.run_store import RunStore
from storage.types import GcReport
from training.loss_config import LossConfig


class CriticStore(RunStore):
    """The run store with checkpoints under ``critic/``; rollouts and the lease
    are the run's own, so reads and fence checks are the policy's."""

    @property
    def _ckpt_dir(self) -> str:
        return self._p("critic", "checkpoints")

    def _advantages_path(self, k: int) -> str:
        return self._p("critic", "advantages", f"{iter_name(k)}.safetensors")

    def write_advantages(self, k: int, advantages: torch.Tensor) -> bool:
        """Persist rollout k's advantages [B, T-1] once; False if already there."""
        self.check_fence()
        blob = safetensors.torch.save({"advantages": advantages.contiguous().cpu()})
        return write_bytes(self.fs, self._advantages_path(k), blob, exclusive=True)

    def read_advantages(self, k: int) -> torch.Tensor | None:
        blob = read_bytes(self.fs, self._advantages_path(k))
        return None if blob is None else safetensors.torch.load(blob)["advantages"]

    def gc(self, keep_last: int) -> GcReport:
        """The policy's retention over the critic's checkpoints: the last ``keep_last``
        committed ones stay (the critic publishes no versions, so none are served)."""
        return gc(self.fs, self._p("critic"), keep_last, {}, guard=self.check_fence)


def policy_advantages(
    loss: LossConfig, storage: StorageConfig, run_name: str, k: int
) -> torch.Tensor | None:
    """What the policy's train(k) uses as token advantages: for advantage gae (PPO)
    the ones the critic wrote for rollouts k, else None (its own estimator)."""
    if loss.advantage != "gae":
        return None
    adv = CriticStore(storage, run_name).read_advantages(k)
    if adv is None:
        raise FileNotFoundError(
            f"train.loss.advantage gae: no critic advantages for iteration {k} in run "
            f"{run_name!r}; run the critic's train({k}) (CriticGroup) before the policy's"
        )
    return adv
