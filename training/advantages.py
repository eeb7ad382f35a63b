"""Advantage estimators: pure functions over a reward tensor [B*n].

Owns the baselines (group, leave-one-out, batch). Samples of one prompt are
``n`` contiguous entries. Never touches models, storage, config or Ray
(``training.algorithm`` picks one from the config). The group and batch
estimators are outcome-only: one scalar reward per sequence, broadcast to its
tokens. ``gae_advantages`` is the critic's: per-token advantages [B, T] from
token rewards and the value model's values.
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


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token rewards [B, T] of outcome rewards [B]: each sample's reward on its last
    response token (``mask`` [B, T], 1 on response tokens), 0 elsewhere."""
    mask = mask.float()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(dim=1).values  # -1: no response token
    out = torch.zeros_like(mask)
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = rewards.float()[rows]
    return out


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation"), as PPO for LMs uses it (Ouyang et al. 2022).

    Over [B, T] token tensors (``mask`` 1 on response tokens, contiguous per row):
    delta_t = r_t + gamma V_{t+1} - V_t with V = 0 after the last response token,
    A_t = delta_t + gamma lam A_{t+1}, and the returns R_t = A_t + V_t (the critic's
    targets). Both are 0 off the mask. Not whitened here (``whiten``).
    """
    mask = mask.float()
    values, rewards = values.float() * mask, token_rewards.float() * mask
    adv = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        next_value = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        adv[:, t] = running
    return adv, (adv + values) * mask


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries of the whole batch (unbiased std),
    0 off the mask; as PPO implementations normalise GAE advantages per batch."""
    mask = mask.float()
    n = mask.sum()
    if n < 2:
        return torch.zeros_like(x)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + eps) * mask
