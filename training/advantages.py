"""Advantage estimators: pure functions over a reward tensor [B*n].

Owns the baselines (group, leave-one-out, batch). Samples of one prompt are
``n`` contiguous entries. Never touches models, storage, config or Ray
(``training.algorithm`` picks one from the config). All of them are
outcome-only: one scalar reward per sequence, broadcast to its tokens; none
uses a critic or per-token rewards.
"""

from __future__ import annotations

import torch


def _groups(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """``rewards`` as float [B, n]; refuses a batch that does not split into groups."""
    if n < 1 or rewards.numel() % n != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of n={n}")
    return rewards.float().view(-1, n)


def grpo_advantages(
    rewards: torch.Tensor, n: int, eps: float = 1e-6, normalize_std: bool = True
) -> torch.Tensor:
    """GRPO (Shao et al. 2024) group-relative advantages of ``rewards`` [B*n].

    A = (r - mean_group) / (std_group + eps), with the unbiased std (as TRL and
    slime use). ``normalize_std=False`` gives Dr. GRPO's mean-centring only.
    A group whose rewards are all equal gets advantage 0, not a division by 0.
    """
    groups = _groups(rewards, n)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std and n > 1:
        std = groups.std(dim=1, keepdim=True)
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    return centred.reshape(-1)


def dr_grpo_advantages(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): A = r - mean_group, no std division, which the
    paper shows biases updates towards too easy and too hard prompts."""
    return grpo_advantages(rewards, n, normalize_std=False)


def rloo_advantages(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, "Back to Basics"): A_i = r_i - mean_{j != i} r_j.

    Each sample's baseline is the mean of the other n - 1 samples of its prompt,
    so the baseline does not depend on the sample itself. This equals
    n / (n - 1) * (r_i - mean_group). Needs n >= 2; no std normalisation.
    """
    if n < 2:
        raise ValueError(f"RLOO needs at least 2 samples per prompt, got n={n}")
    groups = _groups(rewards, n)
    others = (groups.sum(dim=1, keepdim=True) - groups) / (n - 1)
    return (groups - others).reshape(-1)


def _batch_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) over the whole batch; all zeros when std is 0."""
    centred = x - x.mean()
    std = x.std() if x.numel() > 1 else torch.zeros(())
    return centred / (std + eps) if std > 0 else torch.zeros_like(x)


def reinforce_pp_advantages(rewards: torch.Tensor, n: int, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): the return normalised over the whole batch,
    A = (r - mean_batch) / (std_batch + eps) (unbiased std), ignoring groups.

    Left out: the paper's per-token KL reward shaping (the k3 KL here is a
    loss term, ``kl_coef``) and discounting (outcome rewards, gamma = 1).
    ``n`` only checks that the batch is made of whole groups.
    """
    return _batch_normalise(_groups(rewards, n).reshape(-1), eps)


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, n: int, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025): subtract each group's mean reward, then
    normalise by the std of those centred rewards over the whole batch:
    A = (c - mean_batch(c)) / (std_batch(c) + eps), c = r - mean_group.

    mean_batch(c) is 0 up to rounding, and is subtracted as in the paper's code.
    Unlike GRPO, a group with a small spread is not blown up by its own std.
    """
    return _batch_normalise(dr_grpo_advantages(rewards, n), eps)
