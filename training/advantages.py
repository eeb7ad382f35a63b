"""GRPO advantages: a pure function over a reward tensor.

Owns the group-relative baseline. Never touches models, storage or Ray.
"""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards: torch.Tensor, n: int, eps: float = 1e-6, normalize_std: bool = True
) -> torch.Tensor:
    """Group-relative advantages of ``rewards`` [B*n], groups of ``n`` contiguous samples.

    A = (r - mean_group) / (std_group + eps), with the unbiased std (as TRL and
    slime use). ``normalize_std=False`` gives Dr. GRPO's mean-centring only.
    A group whose rewards are all equal gets advantage 0, not a division by 0.
    """
    if n < 1 or rewards.numel() % n != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of n={n}")
    groups = rewards.float().view(-1, n)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std and n > 1:
        std = groups.std(dim=1, keepdim=True)
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    return centred.reshape(-1)
