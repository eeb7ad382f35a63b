"""Evaluation during training: pass@1 and pass@k of the weights engines serve.

Owns the ``eval`` config section (``EvalConfig``), which prompts are evaluated
(``eval_prompts``: the first ``size`` rows of a JSONL/Parquet file, or a
builtin task at prompt indices no training batch or dynamic-sampling round
uses) and the scores. Generation goes through the rollout procedure
(``procedure.generate_batch`` with the prompts given), so evaluation gets the
same encoding, seeds, version check and rewards as training batches:

    greedy    one answer per prompt at temperature 0       -> pass@1 (greedy)
    sampled   ``n_samples`` answers at rollout.temperature  -> pass@1, pass@k (k = n_samples)

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large
Language Models Trained on Code"): 1 - C(n - c, k) / C(n, k) for c passing
answers of n. A sample passes when its reward reaches ``pass_threshold``.
Imports no Prefect, Ray or engines (they come in as ``GenerateGroups``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollout.builtin_tasks import BUILTIN_TASKS
from rollout.config import RolloutConfig
from rollout.datasets import LOADERS, PromptSource, load_prompts
from rollout.procedure import GenerateGroups, RolloutIO, generate_batch
from rollout.rewards import LABEL_CHECKS
from rollout.types import Prompt

# Builtin tasks derive a prompt from its index: evaluation's start past the
# indices of training batches and of dynamic sampling's rounds (2**40 on).
EVAL_INDEX_BASE = 1 << 41
# eval.size at most: each evaluation generates (1 + n_samples) answers per prompt,
# and a size of 1e12 would spend minutes building prompts before the first one.
MAX_EVAL_SIZE = 100_000
# eval.n_samples at most, for the same reason: each is a generation per prompt.
MAX_EVAL_SAMPLES = 1024


class EvalConfig(BaseModel):
    """``eval``: evaluation on the engines during training, off by default."""

    model_config = ConfigDict(extra="forbid")

    interval: int = Field(
        0, ge=0, description="Evaluate every N iterations and after the last; 0: never"
    )
    dataset: str | None = Field(
        None,
        description="Builtin task name or a .jsonl/.parquet file (rollout.input_key and "
        "label_key name its fields); None: rollout.task",
    )
    size: int = Field(
        32, ge=1, le=MAX_EVAL_SIZE, description="Prompts evaluated (a file: its first rows)"
    )
    n_samples: int = Field(
        4,
        ge=1,
        le=MAX_EVAL_SAMPLES,
        description="Sampled answers per prompt: pass@k is reported for k = n_samples",
    )
    before_training: bool = Field(
        True,
        description="Also evaluate the base model (v0) before iteration 1's rollout, on the "
        "same prompts: iteration 1's row gets its scores as eval_base_* (with interval > 0)",
    )
    pass_threshold: float = Field(
        1.0,
        allow_inf_nan=False,  # NaN passes nothing: every pass@k would read 0
        description="A sample passes when its reward is at least this",
    )

    @field_validator("dataset")
    @classmethod
    def _known_kind(cls, v: str | None) -> str | None:
        # Checked at load: a typo would otherwise fail the first evaluation, hours in.
        # (Every row of the file is read by tasks.prepare.check_run, before the run starts.)
        if v is None or v in BUILTIN_TASKS or Path(v).suffix.lower() in LOADERS:
            return v
        raise ValueError(
            f"eval.dataset {v!r} is neither a builtin task ({', '.join(BUILTIN_TASKS)}) nor a "
            f"{' or '.join(LOADERS)} file; give one of those"
        )


def due(cfg: EvalConfig, k: int, last: int) -> bool:
    """Whether iteration k (of ``last``) is evaluated; k = 0 is the base model, before
    iteration 1's rollout (``eval.before_training``)."""
    if cfg.interval <= 0:
        return False
    if k == 0:
        return cfg.before_training
    return k % cfg.interval == 0 or k == last


def eval_prompts(cfg: EvalConfig, rollout: RolloutConfig, seed: int) -> list[Prompt]:
    """The evaluated prompts: the same ones at every evaluation of a run."""
    dataset = cfg.dataset or rollout.task
    if dataset in BUILTIN_TASKS:
        source = PromptSource(rollout.model_copy(update={"task": dataset}), seed)
        return source.prompts(range(EVAL_INDEX_BASE, EVAL_INDEX_BASE + cfg.size))
    key = "eval.dataset" if cfg.dataset else "rollout.task"
    check = LABEL_CHECKS.get(rollout.reward)
    return load_prompts(dataset, rollout.input_key, rollout.label_key, key, check)[: cfg.size]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k answers drawn from n (c of them passing) passes."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(
    cfg: EvalConfig,
    rollout: RolloutConfig,
    seed: int,
    k: int,
    version: int,
    tokenizer: Any,
    generate_groups: GenerateGroups,
    restart: Callable[[int], None],
    io: RolloutIO | None = None,
) -> dict[str, Any]:
    """Evaluate weights ``version`` after iteration k: the evaluate step's result.
    ``io``: the engines' HTTP API and scoring, as rollout k's (multi-turn needs it)."""
    prompts = eval_prompts(cfg, rollout, seed)
    t0 = time.perf_counter()

    def passed(temperature: float, n: int) -> list[int]:
        # model_copy does not validate: temperature 0 (greedy) is the engines' argmax.
        settings = rollout.model_copy(
            update={"temperature": temperature, "n_samples_per_prompt": n}
        )
        out = generate_batch(
            settings, seed, k, version, tokenizer, generate_groups, restart, prompts=prompts, io=io
        )
        ok = [s.reward >= cfg.pass_threshold for s in out.batch.samples]
        return [sum(ok[i : i + n]) for i in range(0, len(ok), n)]

    greedy = passed(0.0, 1)
    n = cfg.n_samples
    sampled = passed(rollout.temperature, n)
    return {
        "evaluated": True,
        "version": version,
        "prompts": len(prompts),
        "n_samples": n,
        "pass_at_1_greedy": sum(greedy) / len(prompts),
        "pass_at_1": sum(pass_at_k(n, c, 1) for c in sampled) / len(prompts),
        "pass_at_k": sum(pass_at_k(n, c, n) for c in sampled) / len(prompts),
        "eval_s": time.perf_counter() - t0,
    }


def row_fields(result: dict[str, Any] | None, prefix: str = "eval") -> dict[str, Any]:
    """The metrics row's eval columns from the evaluate step's result ({} when not run);
    ``prefix`` ``eval_base``: the base model's, in iteration 1's row."""
    if not result or not result.get("evaluated"):
        return {}
    return {
        f"{prefix}_pass_at_1_greedy": result["pass_at_1_greedy"],
        f"{prefix}_pass_at_1": result["pass_at_1"],
        f"{prefix}_pass_at_k": result["pass_at_k"],
        f"{prefix}_k": result["n_samples"],
    }
