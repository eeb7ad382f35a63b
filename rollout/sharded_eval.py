"""Evaluation of one version in shards: what one shard scores and how shards add up.

Owns ``score_shard`` (greedy and sampled answers for a slice of the evaluated
prompts, through the rollout procedure) and ``version_scores`` (the numbers of
a version from its shards). A shard keeps per-prompt counts, never averages, so
the merged scores are computed once over all prompts, in prompt order, with the
same arithmetic as ``rollout.evaluation.evaluate``: a sharded evaluation equals
a single-process one of the same prompts exactly, not to rounding.

Generation is ``rollout.evaluation.evaluate``'s: temperature 0 and one answer
per prompt (greedy), then ``n_samples`` answers at the given temperature, seeds
``(seed, k, prompt index, j)`` with k = the version (what evaluate[k] of
iteration k uses when it serves v = k). Imports no Prefect, Ray or engines.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rollout.config import RolloutConfig
from rollout.evaluation import pass_at_k
from rollout.procedure import GenerateGroups, RolloutIO, generate_batch
from rollout.types import Prompt


@dataclass(frozen=True)
class ShardScore:
    """What one (version, shard) produced; plain JSON (a task result and the record)."""

    version: int  # the weights version evaluated
    shard: int  # the shard's position among the version's shards
    prompt_indices: list[int]  # the prompts' indices, in order
    greedy_pass: list[int]  # [P] 1 if the greedy answer passed
    sampled_pass: list[int]  # [P] passing answers among the n sampled
    n_samples: int  # sampled answers per prompt
    reward_sum: float  # sum of the sampled answers' rewards
    greedy_reward_sum: float  # sum of the greedy answers' rewards
    response_tokens: int  # generated tokens, greedy and sampled
    gen_s: float  # seconds of generation (both rounds)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShardScore:
        return cls(**data)


def split(prompts: Sequence[Prompt], shard_size: int) -> list[list[Prompt]]:
    """Contiguous shards of ``shard_size`` prompts (the last may be shorter)."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    return [list(prompts[i : i + shard_size]) for i in range(0, len(prompts), shard_size)]


def prompts_digest(prompts: Sequence[Prompt]) -> str:
    """sha256 of the prompts (index, text, label): the dataset part of a shard's cache key."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.index, p.text, p.label]).encode())
        h.update(b"\n")
    return h.hexdigest()


def score_shard(
    rollout: RolloutConfig,
    pass_threshold: float,
    n_samples: int,
    seed: int,
    version: int,
    shard: int,
    prompts: list[Prompt],
    tokenizer: Any,
    generate_groups: GenerateGroups,
    restart: Callable[[int], None],
    io: RolloutIO | None = None,
) -> ShardScore:
    """Greedy and sampled answers to ``prompts`` from the engines serving ``version``,
    scored by ``rollout.reward`` (``rollout.temperature`` is the sampled round's)."""
    gen_s, tokens, sums = 0.0, 0, []
    counts = []
    for temperature, n in ((0.0, 1), (rollout.temperature, n_samples)):
        # model_copy does not validate: temperature 0 (greedy) is the engines' argmax.
        settings = rollout.model_copy(
            update={"temperature": temperature, "n_samples_per_prompt": n}
        )
        out = generate_batch(
            settings, seed, version, version, tokenizer, generate_groups, restart, prompts, io
        )
        samples = out.batch.samples
        ok = [s.reward >= pass_threshold for s in samples]
        counts.append([sum(ok[i : i + n]) for i in range(0, len(ok), n)])
        sums.append(sum(s.reward for s in samples))
        tokens += sum(len(s.response_ids) for s in samples)
        gen_s += out.gen_s or 0.0
    return ShardScore(
        version=version,
        shard=shard,
        prompt_indices=[p.index for p in prompts],
        greedy_pass=counts[0],
        sampled_pass=counts[1],
        n_samples=n_samples,
        reward_sum=sums[1],
        greedy_reward_sum=sums[0],
        response_tokens=tokens,
        gen_s=gen_s,
    )


def version_scores(shards: Sequence[ShardScore]) -> dict[str, Any]:
    """One version's numbers from all its shards (any order): pass@1 greedy and
    sampled, pass@k (k = n_samples), mean rewards, tokens; as ``evaluate`` computes them."""
    if not shards:
        raise ValueError("no shards to merge")
    ordered = sorted(shards, key=lambda s: s.shard)
    versions = {s.version for s in ordered}
    if len(versions) != 1 or [s.shard for s in ordered] != list(range(len(ordered))):
        raise ValueError(
            f"shards of versions {sorted(versions)} at {[s.shard for s in ordered]}: "
            "give every shard of one version once"
        )
    n = ordered[0].n_samples
    greedy = [c for s in ordered for c in s.greedy_pass]
    sampled = [c for s in ordered for c in s.sampled_pass]
    prompts = len(greedy)
    return {
        "version": ordered[0].version,
        "prompts": prompts,
        "shards": len(ordered),
        "n_samples": n,
        "pass_at_1_greedy": sum(greedy) / prompts,
        "pass_at_1": sum(pass_at_k(n, c, 1) for c in sampled) / prompts,
        "pass_at_k": sum(pass_at_k(n, c, n) for c in sampled) / prompts,
        "reward_mean": sum(s.reward_sum for s in ordered) / (prompts * n),
        "reward_mean_greedy": sum(s.greedy_reward_sum for s in ordered) / prompts,
        "response_tokens": sum(s.response_tokens for s in ordered),
        "gen_s": sum(s.gen_s for s in ordered),
    }
