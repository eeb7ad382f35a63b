"""The rollout procedure of one iteration: prompts to scored samples.

Owns: which prompts (``PromptSource``), their token ids, the per-sample seeds
``(seed, k, prompt, j)``, the sampling parameters, the check that every sample
came from the version the step expects, rewards, and the ``RolloutBatch``. The
engines are reached only through ``GenerateGroups``, a callable with the
signature of ``engines.group.EngineGroup.generate_groups``: this module must not
import engines, tasks or Ray, so it runs the same against a fake in a unit test.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from rollout import dynamic_sampling
from rollout.config import RolloutConfig
from rollout.datasets import PromptSource, encode_prompt
from rollout.rewards import load_reward
from rollout.seeding import sample_seed
from rollout.types import Prompt, RolloutBatch, Sample


class VersionMismatch(RuntimeError):
    """An engine serves another weight version than the step expects."""


class GenerateGroups(Protocol):
    """``EngineGroup.generate_groups``: n samples per prompt, results in prompt order."""

    def __call__(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: dict[str, Any],
        seeds: list[list[int]],
        restart_fn: Callable[[int], None] | None = None,
    ) -> list[list[dict[str, Any]]]: ...


@dataclass(frozen=True)
class Generated:
    batch: RolloutBatch  # the scored samples, ready to persist
    gen_s: float  # wall seconds the engines spent generating


def sampling_params(cfg: RolloutConfig) -> dict[str, Any]:
    """The per-request sampling parameters (the seed is added per sample)."""
    return {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_new_tokens": cfg.max_new_tokens,
    }


def generate_batch(
    cfg: RolloutConfig,
    seed: int,
    k: int,
    version: int,
    tokenizer: Any,
    generate_groups: GenerateGroups,
    restart: Callable[[int], None],
    prompts: list[Prompt] | None = None,
) -> Generated:
    """Generate, check and score rollout k with weights ``version``.

    ``restart(i)`` brings a dead engine i back on ``version``; its groups are
    regenerated whole by ``generate_groups``, so no group mixes versions.
    ``prompts``: one more round of dynamic sampling (default: batch k's prompts)."""
    reward_fn = load_reward(cfg.reward, cfg.trusted_reward_modules)
    source = PromptSource(cfg, seed)
    first_round = prompts is None
    prompts = source.batch(k) if first_round else prompts
    n = cfg.n_samples_per_prompt
    prompt_ids = [encode_prompt(tokenizer, p.text, cfg.chat_template) for p in prompts]
    seeds = [[sample_seed(seed, k, p.index, j) for j in range(n)] for p in prompts]
    t0 = time.perf_counter()
    groups = generate_groups(prompt_ids, n, sampling_params(cfg), seeds, restart_fn=restart)
    gen_s = time.perf_counter() - t0
    samples: list[Sample] = []
    for p, ids, outs in zip(prompts, prompt_ids, groups):
        for j, out in enumerate(outs):
            meta = out["meta_info"]
            served = int(meta["weight_version"])
            if served != version:
                raise VersionMismatch(
                    f"rollout[k={k}]: a sample came from weights v{served}, expected v{version}; "
                    "the engines were not reloaded: rerun reload_engines"
                )
            finish = meta["finish_reason"]["type"]
            if finish == "abort":
                raise RuntimeError(f"rollout[k={k}]: a request was aborted; retry the rollout")
            text = tokenizer.decode(out["output_ids"], skip_special_tokens=True)
            samples.append(
                Sample(
                    prompt_index=p.index,
                    sample_index=j,
                    prompt_ids=list(ids),
                    response_ids=list(out["output_ids"]),
                    response_logprobs=[float(x[0]) for x in meta["output_token_logprobs"]],
                    reward=float(reward_fn(text, p.label)),
                    weight_version=served,
                    finish_reason=finish,
                    response_text=text,
                )
            )
    out = Generated(RolloutBatch(iteration=k, n_samples_per_prompt=n, samples=samples), gen_s)
    if not first_round:
        return out
    # -- hook: DAPO dynamic sampling (rollout/dynamic_sampling.py; off by default) --
    more = partial(generate_batch, cfg, seed, k, version, tokenizer, generate_groups, restart)
    return dynamic_sampling.fill(cfg, source, k, out, lambda ps: more(prompts=ps))


def summary(batch: RolloutBatch, gen_s: float | None, reused: bool) -> dict[str, Any]:
    """The rollout step's ledger result (keys as persisted since the first ledgers)."""
    rewards = batch.rewards
    tokens = sum(len(s.response_ids) for s in batch.samples)
    return {
        "reward_mean": sum(rewards) / len(rewards),
        "reward_max": max(rewards),
        "samples": len(rewards),
        "response_tokens": tokens,
        "gen_s": gen_s,
        "gen_tokens_per_s": (tokens / gen_s) if gen_s else None,
        "weight_version": batch.samples[0].weight_version if batch.samples else None,
        "reused": reused,
        "example": batch.samples[0].response_text if batch.samples else "",
    }
