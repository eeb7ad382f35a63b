"""Turn a persisted RolloutBatch into training tensors, and split them.

Owns the token layout of a train batch (padding, next-token shift, loss mask)
and the deterministic split over ranks and micro-batches (by rows, or by a
token budget balanced across ranks). Never runs a model and never reads
storage; packing the rows of a micro-batch into one is the backend's
(``backend_torch.pack_rows``), since it is a forward-pass layout.

Layout for a sample with prompt P and response R (lengths p, r)::

    input_ids   [P0 .. Pp-1 R0 .. Rr-1 pad ..]        [B, T], T = max(p + r)
    targets     input_ids[:, 1:]                       [B, T-1]
    loss_mask   1 where targets[t] is a response token [B, T-1]
                (t in p-1 .. p+r-2: logits at t predict token t+1);
                multi-turn: only the model's tokens (Sample.loss_mask)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from rollout.types import RolloutBatch
from training.algorithm import filter_loss_mask, sample_advantages
from training.config import TrainConfig
from training.loss_config import LossConfig
from training.types import UnusableRollout


@dataclass(frozen=True)
class TrainBatch:
    input_ids: torch.Tensor  # [B, T] long, right-padded with pad_id
    attention_mask: torch.Tensor  # [B, T] long, 1 on prompt + response tokens
    loss_mask: torch.Tensor  # [B, T-1] float, 1 where the target is a response token
    rollout_logprobs: torch.Tensor  # [B, T-1] float, engine logprobs on loss_mask, else 0
    advantages: torch.Tensor  # [B] float per sample, or [B, T-1] per token (gae)
    rewards: torch.Tensor  # [B] float

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Loss tokens (response tokens) in this batch."""
        return int(self.loss_mask.sum().item())

    def rows(self, start: int, end: int) -> TrainBatch:
        """Rows [start, end), trimmed to their longest sequence (saves compute on padding)."""
        length = max(int(self.attention_mask[start:end].sum(dim=1).max().item()), 2)
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)[start:end]
            if t.dim() == 2:
                shifted = f.name in ("loss_mask", "rollout_logprobs", "advantages")
                t = t[:, : length - (1 if shifted else 0)]
            out[f.name] = t
        return TrainBatch(**out)


def build_train_batch(
    batch: RolloutBatch,
    pad_id: int,
    loss_cfg: LossConfig | None = None,
    token_advantages: torch.Tensor | None = None,
) -> TrainBatch:
    """Tensors for ``batch``; advantages (``loss_cfg.advantage``, default GRPO) are
    computed over the whole batch's groups, except gae: the critic's per-token
    ``token_advantages`` [B, T-1] (this layout) are used as they are."""
    if not batch.samples:
        raise ValueError(f"rollout batch of iteration {batch.iteration} has no samples")
    seqs = [list(s.prompt_ids) + list(s.response_ids) for s in batch.samples]
    size, length = len(seqs), max(2, max(len(q) for q in seqs))
    input_ids = torch.full((size, length), pad_id, dtype=torch.long)
    attention = torch.zeros((size, length), dtype=torch.long)
    loss_mask = torch.zeros((size, length - 1), dtype=torch.float32)
    rollout_lp = torch.zeros((size, length - 1), dtype=torch.float32)
    cfg = LossConfig() if loss_cfg is None else loss_cfg
    for i, (s, seq) in enumerate(zip(batch.samples, seqs)):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if p < 1:
            raise ValueError(f"sample {i} has an empty prompt; a prompt needs at least bos")
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[i, : len(seq)] = 1
        # multi-turn: tool tokens are context, not actions (Sample.loss_mask)
        mask = 1.0 if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
        loss_mask[i, p - 1 : p + r - 1] = mask
        if r and len(s.response_logprobs) == r:
            rollout_lp[i, p - 1 : p + r - 1] = torch.tensor(s.response_logprobs)
        elif r and cfg.rollout_correction.kind != "none":
            # A missing logprob would read as 0 (probability 1) and skew every weight.
            raise UnusableRollout(
                f"sample {i} of rollout batch {batch.iteration} has "
                f"{len(s.response_logprobs)} engine logprobs for {r} response tokens; "
                "train.loss.rollout_correction needs one per token"
            )
    rewards = torch.tensor(batch.rewards, dtype=torch.float32)
    lengths = torch.tensor([len(s.response_ids) for s in batch.samples])
    if cfg.advantage == "gae" and token_advantages is not None:
        if tuple(token_advantages.shape) != tuple(loss_mask.shape):
            raise ValueError(
                f"token advantages of shape {tuple(token_advantages.shape)} do not fit the "
                f"batch layout {tuple(loss_mask.shape)}; they belong to another rollout batch"
            )
        advantages = token_advantages.float()
    else:
        advantages = sample_advantages(cfg, rewards, batch.n_samples_per_prompt, lengths)
        _check_finite(batch, rewards, advantages, cfg.advantage)
    loss_mask = filter_loss_mask(cfg, loss_mask, [s.finish_reason for s in batch.samples])
    return TrainBatch(input_ids, attention, loss_mask, rollout_lp, advantages, rewards)


def _check_finite(
    batch: RolloutBatch, rewards: torch.Tensor, advantages: torch.Tensor, estimator: str
) -> None:
    """UnusableRollout naming the first sample whose reward, else advantage, is not finite."""
    where = f"of rollout batch {batch.iteration} has reward"
    bad = (~torch.isfinite(rewards)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise UnusableRollout(
            f"sample {i} {where} {batch.samples[i].reward:g}, beyond the trainer's float32"
        )
    bad = (~torch.isfinite(advantages)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise UnusableRollout(
            f"sample {i} {where} {batch.samples[i].reward:g}, which gives advantage "
            f"{float(advantages[i])} ({estimator}, float32)"
        )


def rank_slice(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous rows [start, end) of ``rank``. Equal sizes, because every rank
    must run the same number of micro-batches (FSDP collectives pair up)."""
    if size % world_size != 0:
        raise ValueError(
            f"a train batch of {size} samples does not split over {world_size} ranks; "
            "make prompts_per_iteration * n_samples_per_prompt a multiple of num_workers"
        )
    per = size // world_size
    return rank * per, (rank + 1) * per


def micro_batches(batch: TrainBatch, micro_batch_size: int) -> list[TrainBatch]:
    """Consecutive micro-batches of at most ``micro_batch_size`` rows, in order."""
    return [
        batch.rows(i, min(i + micro_batch_size, batch.size))
        for i in range(0, batch.size, micro_batch_size)
    ]


def token_cost(lengths: Sequence[int], packed: bool) -> int:
    """Tokens a forward over these rows processes: their sum when packed, else
    rows x the longest (the padded [B, T] block the model really runs)."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def budget_ranges(
    lengths: Sequence[int], max_rows: int, max_tokens: int | None, packed: bool
) -> list[tuple[int, int]]:
    """Consecutive row ranges [start, end): each closes before the next row would
    pass ``max_rows`` or ``max_tokens`` (``token_cost``). Greedy and in order, so
    the split is a function of the lengths alone (determinism); a row longer
    than the budget gets a range of its own rather than failing the step."""
    ranges: list[tuple[int, int]] = []
    start = 0
    for end in range(1, len(lengths) + 1):
        rows = end - start
        over = max_tokens is not None and token_cost(lengths[start:end], packed) > max_tokens
        if rows > 1 and (rows > max_rows or over):
            ranges.append((start, end - 1))
            start = end - 1
    if start < len(lengths):
        ranges.append((start, len(lengths)))
    return ranges


def split_to(ranges: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """``ranges`` split until there are ``count``: the range with most rows (the
    first on ties) is halved, so a rank with fewer micro-batches matches the others."""
    out = list(ranges)
    while len(out) < count:
        i = max(range(len(out)), key=lambda j: (out[j][1] - out[j][0], -j))
        a, b = out[i]
        if b - a < 2:
            raise ValueError(f"cannot split {ranges} into {count} micro-batches")
        out[i : i + 1] = [(a, (a + b) // 2), ((a + b) // 2, b)]
    return out


def rank_micro_batches(
    full: TrainBatch, dp_rank: int, dp_size: int, cfg: TrainConfig
) -> list[TrainBatch]:
    """The micro-batches of data-parallel rank ``dp_rank`` of ``full``.

    Without ``cfg.max_tokens_per_micro_batch`` these are ``micro_batches`` of
    the rank's rows. With it, micro-batches are also cut by a token budget
    (``budget_ranges``, counting packed tokens when ``cfg.pack_sequences``);
    every rank plans every rank's split from the same full batch (no
    communication) and splits its own to the largest count, because FSDP
    collectives pair up one forward/backward per micro-batch on every rank.
    """
    max_tokens, packed = cfg.max_tokens_per_micro_batch, cfg.pack_sequences
    micro_batch_size = cfg.micro_batch_size
    if max_tokens is None:
        start, end = rank_slice(full.size, dp_rank, dp_size)
        return micro_batches(full.rows(start, end), micro_batch_size)
    lengths = full.attention_mask.sum(dim=1).tolist()
    plans = []
    for r in range(dp_size):
        start, end = rank_slice(full.size, r, dp_size)
        plans.append(
            (start, budget_ranges(lengths[start:end], micro_batch_size, max_tokens, packed))
        )
    start, own = plans[dp_rank]
    own = split_to(own, max(len(p) for _, p in plans))
    return [full.rows(start + a, start + b) for a, b in own]
