"""The rollout procedure of one iteration: prompts to scored samples.

Owns: which prompts (``PromptSource``), their token ids, the per-sample seeds
``(seed, k, prompt, j)``, the sampling parameters, the check that every sample
came from the version the step expects, rewards, and the ``RolloutBatch``. The
engines are reached only through ``GenerateGroups``, a callable with the
signature of ``engines.group.EngineGroup.generate_groups``, or, for multi-turn
episodes (``rollout.environment``, ``rollout.agent``), through ``TurnEngines``
(their SGLang ``/generate``); rewards through a ``Scorer`` (default: in this
process). ``RolloutIO`` carries these from the caller: this module must not
import engines, tasks or Ray, so it runs the same against a fake in a unit test.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Protocol

from rollout import dynamic_sampling, rewards
from rollout.agent import TurnEngines, run_episodes, tool_use
from rollout.config import RolloutConfig
from rollout.datasets import PromptSource, encode_prompt
from rollout.failures import FailureLog, VersionMismatch
from rollout.rewards import Scorer
from rollout.seeding import sample_seed
from rollout.types import Generated, Prompt, RolloutBatch, Sample

__all__ = [
    "Generated",
    "RolloutIO",
    "VersionMismatch",
    "generate_batch",
    "scored",
    "single_turn",
    "summary",
]


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
class RolloutIO:
    """What a rollout reaches besides ``generate_groups``; None: the in-process default."""

    turns: TurnEngines | None = None  # multi-turn (rollout.environment): the engines' /generate
    score: Scorer | None = None  # scores a batch (default: rollout.rewards.score, in process)
    failures: FailureLog | None = None  # multi-turn: the step's failure log (default: in memory)


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
    io: RolloutIO | None = None,
) -> Generated:
    """Generate, check and score rollout k with weights ``version``.

    ``restart(i)`` brings a dead engine i back on ``version``; its groups are
    regenerated whole by ``generate_groups``, so no group mixes versions.
    ``prompts``: one more round of dynamic sampling (default: batch k's prompts).
    Multi-turn (``rollout.environment``): episodes through ``io.turns``, failed
    prompts replaced or dropped (``rollout.failures``, recorded in ``io.failures``)."""
    io = io or RolloutIO()
    source = PromptSource(cfg, seed)
    first_round = prompts is None
    prompts = source.batch(k) if first_round else prompts
    multi_turn = cfg.environment != "none"
    if multi_turn and io.failures is None:
        io = replace(io, failures=FailureLog(cfg.failures, k, cfg.batch_size))
    n = cfg.n_samples_per_prompt
    t0 = time.perf_counter()
    if multi_turn:
        if io.turns is None:
            raise ValueError(f"rollout.environment {cfg.environment!r} needs the engines' HTTP API")
        episodes = run_episodes(
            cfg,
            seed,
            k,
            version,
            tokenizer,
            io.turns,
            prompts,
            io.failures,
            sampling_params(cfg),
            spares=lambda index: source.prompts([index])[0],
            encode_prompt=lambda text: encode_prompt(tokenizer, text, cfg.chat_template),
        )
        prompts, samples, answers = episodes.prompts, episodes.samples, episodes.answers
    else:
        samples = single_turn(cfg, seed, k, version, tokenizer, generate_groups, restart, prompts)
        answers = [s.response_text for s in samples]
    gen_s = time.perf_counter() - t0
    samples = scored(cfg, io.score, prompts, samples, answers)
    batch = RolloutBatch(
        iteration=k, n_samples_per_prompt=n, samples=samples, temperature=cfg.temperature
    )
    out = Generated(batch, gen_s)
    if not first_round:
        return out
    # -- hook: DAPO dynamic sampling (rollout/dynamic_sampling.py; off by default) --
    more = partial(
        generate_batch, cfg, seed, k, version, tokenizer, generate_groups, restart, io=io
    )
    out = dynamic_sampling.fill(cfg, source, k, out, lambda ps: more(prompts=ps))
    if multi_turn:  # every round's retries and drops
        out = replace(out, batch=replace(out.batch, failures=io.failures.record()))
    return out


def single_turn(
    cfg: RolloutConfig,
    seed: int,
    k: int,
    version: int,
    tokenizer: Any,
    generate_groups: GenerateGroups,
    restart: Callable[[int], None],
    prompts: list[Prompt],
) -> list[Sample]:
    """One completion per sample (through ``generate_groups``), not scored yet."""
    n = cfg.n_samples_per_prompt
    prompt_ids = [encode_prompt(tokenizer, p.text, cfg.chat_template) for p in prompts]
    seeds = [[sample_seed(seed, k, p.index, j) for j in range(n)] for p in prompts]
    groups = generate_groups(prompt_ids, n, sampling_params(cfg), seeds, restart_fn=restart)
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
            samples.append(
                Sample(
                    prompt_index=p.index,
                    sample_index=j,
                    prompt_ids=list(ids),
                    response_ids=list(out["output_ids"]),
                    response_logprobs=[float(x[0]) for x in meta["output_token_logprobs"]],
                    reward=0.0,
                    weight_version=served,
                    finish_reason=finish,
                    response_text=tokenizer.decode(out["output_ids"], skip_special_tokens=True),
                )
            )
    return samples


def scored(
    cfg: RolloutConfig,
    score: Scorer | None,
    prompts: list[Prompt],
    samples: list[Sample],
    answers: list[str],
) -> list[Sample]:
    """``samples`` with their reward: rollout.reward's score of each answer, plus
    the environment's step rewards (0 for single-turn samples)."""
    by_index = {p.index: p for p in prompts}
    items = [
        {
            "prompt": by_index[s.prompt_index].text,
            "response": answer,
            "label": by_index[s.prompt_index].label,
            "prompt_index": s.prompt_index,
            "sample_index": s.sample_index,
            "turns": [{"role": t.role, "text": t.text} for t in s.turns],
        }
        for s, answer in zip(samples, answers)
    ]
    scores = score(items) if score is not None else rewards.score(cfg, items)
    if len(scores) != len(samples):
        raise RuntimeError(
            f"reward scoring returned {len(scores)} rewards for {len(samples)} samples"
        )
    return [replace(s, reward=s.reward + float(r)) for s, r in zip(samples, scores)]


def summary(
    batch: RolloutBatch, gen_s: float | None, reused: bool, environment: str = "none"
) -> dict[str, Any]:
    """The rollout step's ledger result (keys as persisted since the first ledgers);
    multi-turn (``environment``) adds how the batch used its tools."""
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
        **_versions(batch),
        "reused": reused,
        "example": batch.samples[0].response_text if batch.samples else "",
        "failures": _failure_counts(batch),
        "sampling": dynamic_sampling.counts(batch),  # hook: DAPO dynamic sampling's record
        "tools": tool_use(batch.samples, environment) if environment != "none" else None,
    }


def _versions(batch: RolloutBatch) -> dict[str, list[int]]:
    """Partial rollouts (``rollout.partial``): every version the batch's tokens came from."""
    if not any(s.token_versions is not None for s in batch.samples):
        return {}
    return {"versions": sorted({v for s in batch.samples for v in s.versions})}


def _failure_counts(batch: RolloutBatch) -> dict[str, int] | None:
    """Multi-turn: how many calls were retried and prompts replaced or dropped."""
    if batch.failures is None:
        return None
    drops = batch.failures.drops
    return {
        "retries": len(batch.failures.retries),
        "replaced": sum(d.replacement is not None for d in drops),
        "dropped": sum(d.replacement is None for d in drops),
    }
