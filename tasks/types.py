"""Typed results of the iteration's steps: what ``ledger/iter_k/<step>.json``
holds under ``result``, and what each Prefect task run returns.

Each ``Step`` declares its result model (``Step.result``); the runner validates
the step's output against it before the commit, so a step cannot commit a shape
its readers do not expect. They travel as JSON dicts (the ledger, Prefect's
persisted results): ``model_dump(exclude_unset=True)`` keeps a record exactly
what the step set. Records already in a ledger are returned as they are, never
re-validated, so a run written by an older version still resumes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class StepResult(BaseModel):
    """What every step may add: warnings to show, and device states when colocated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    warnings: list[str] = []  # e.g. a corrupt checkpoint skipped, a background save lost
    memory: dict[str, Any] | None = None  # colocated: device states the step left


class RolloutResult(StepResult):
    reward_mean: float  # mean reward of the batch
    reward_max: float
    samples: int  # batch_size * n_samples_per_prompt
    response_tokens: int
    gen_s: float | None  # generation seconds; None when the batch was reused
    gen_tokens_per_s: float | None
    weight_version: int | None  # the version every sample came from (partial: its head's)
    # partial rollouts (rollout.partial): every version the tokens came from, oldest first
    versions: list[int] | None = None
    reused: bool  # True: the persisted batch of an earlier attempt
    example: str  # one response, for the console line
    # multi-turn: {retries, replaced, dropped} of rollout.failures; None for single-turn
    failures: dict[str, int] | None = None
    # rollout.dynamic_sampling: {rounds, prompts, dropped_groups, filled_uniform,
    # reward_mean_generated, unused_groups}; None when off
    sampling: dict[str, float | int | None] | None = None
    # multi-turn: {calls, bad_calls, call_rate, correct, correct_after_call} (rollout.agent.tool_use)
    tools: dict[str, float | int | None] | None = None


class RolloutHeadResult(StepResult):
    """Partial rollouts: the head of batch k (``rollout.partial``), persisted unscored."""

    samples: int  # batch_size * n_samples_per_prompt
    response_tokens: int  # tokens of the head, at most partial_chunk per sample
    unfinished: int  # samples the continuation goes on with
    gen_s: float | None  # generation seconds; None when the head was reused
    weight_version: int  # the version every head token came from
    reused: bool  # True: the persisted head of an earlier attempt


class TrainResult(StepResult):
    """Trainer metrics, already all-reduced; losses add their own (pg_loss, clip_frac, ...)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    iteration: int
    loss: float
    kl: float | None = None
    tokens_per_s: float | None = None


class SaveResult(StepResult):
    saved: bool  # False: not due this iteration
    existing: bool = False  # the checkpoint was already committed
    background: bool = False  # written by a thread after the step returned
    save_s: float | None = None


class PublishResult(StepResult):
    published: bool  # False: not due (in-memory transports publish every publish_interval)
    version: int | None = None
    url: str | None = None  # the version folder
    bytes: int | None = None  # total bytes of its files (unknown while written in the background)
    publish_s: float | None = None  # 0.0: already committed
    background: bool = False  # written by a thread after the step returned


class ReloadResult(StepResult):
    engine: int
    version: int  # what the engine serves after the step
    reload_s: float
    # Read from the engine node's cache: storage.Pulled (path, copied, bytes, seconds) and
    # the Ray node id; copied is False when another engine of the node had pulled it.
    pull: dict[str, Any] | None = None
    # An in-memory push: path (streamed, resident, broadcast), signal (socket, ray),
    # bound (the trainer's weights are the staging buffer: nothing was copied), bytes,
    # buckets and the train rank's own seconds (``training.weight_sender``).
    push: dict[str, Any] | None = None


class VerifyRecord(StepResult):
    """``ledger/iter_k/verify-e{i}.json``: what verify saw when it last passed."""

    engine: int  # engine id
    version: int  # the version the engine must serve (and serves: the check passed)
    verified: bool  # always True: a failed check raises instead of recording
    served: str  # what the engine reported on /model_info
    rollout_weight_version: int | None  # weight_version of rollout k's samples (None: no record)
    rollout_expected: int | None  # the version those samples had to come from
    checked_at: str  # UTC ISO time of the check


class EvalResult(StepResult):
    """The evaluate step (``rollout.evaluation``): scores of the version served after k."""

    evaluated: bool  # False: not due this iteration (eval.interval)
    version: int | None = None  # the weights evaluated
    prompts: int | None = None  # eval.size (fewer when the file is shorter)
    n_samples: int | None = None  # k of pass@k
    pass_at_1_greedy: float | None = None  # one answer at temperature 0
    pass_at_1: float | None = None  # sampled answers at rollout.temperature
    pass_at_k: float | None = None  # k = n_samples
    eval_s: float | None = None


class IterationRow(StepResult):
    """The iteration's commit: its metrics row (``metrics/iter_k.json``)."""

    iteration: int
    reward_mean: float
    # The newest weights the batch came from: v(k-1-N) at rollout.max_staleness N (with
    # rollout.partial, the continuation's). reward_mean measures them, not the newest.
    rollout_version: int | None = None
    loss: float | None
    kl: float | None
    # The engines' logprobs against the trainer's (training.types.MISMATCH_METRICS);
    # None in rows of a trainer that does not report them.
    rollout_logprob_abs_diff: float | None = None
    rollout_logprob_kl: float | None = None
    rollout_correction_frac: float | None = None
    # train.mismatch: rollout_logprob_kl over max_kl for a batch the trainer's own
    # weights made (the engines and the trainer score one model differently); None
    # where the gate does not apply (off-policy after the first batches, or no gate).
    rollout_logprob_kl_over: bool | None = None
    gen_tokens_per_s: float | None
    train_tokens_per_s: float | None
    publish_s: float | None
    reload_s: float
    # Bytes one engine received for the weights (tasks.metrics_row.sync_bytes).
    sync_bytes: int | None = None
    example: str | None
    # Set only in evaluated iterations (rollout.evaluation.row_fields).
    eval_pass_at_1_greedy: float | None = None
    eval_pass_at_1: float | None = None
    eval_pass_at_k: float | None = None
    eval_k: int | None = None
    # Iteration 1 only: the base model's scores (eval.before_training).
    eval_base_pass_at_1_greedy: float | None = None
    eval_base_pass_at_1: float | None = None
    eval_base_pass_at_k: float | None = None
    eval_base_k: int | None = None
    # Set only for multi-turn rollouts (rollout.agent.tool_row_fields).
    tool_call_rate: float | None = None
    tool_correct_after_call: float | None = None
    # Set only with dynamic sampling (rollout.dynamic_sampling.sampling_row_fields).
    reward_mean_generated: float | None = None
    sampling_rounds: int | None = None
