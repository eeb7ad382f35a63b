"""Wire objects of the rollout step: prompts, samples (with their turns), the
failure record and the persisted batch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Prompt:
    index: int  # position in the task's dataset; seeds sampling with (seed, k, index, j)
    text: str  # the prompt as text
    label: str  # reference answer the reward compares against


@dataclass(frozen=True)
class Turn:
    """One turn of a multi-turn episode: the model's, or an environment's observation."""

    role: str  # "model" (generated, in the loss) | "tool" (an observation, masked out)
    ids: list[int]  # [n] token ids of the turn
    text: str  # the turn decoded (model) or as the environment wrote it (tool)
    logprobs: list[float] = field(default_factory=list)  # [n] engine logprobs; [] for tool
    weight_version: int | None = None  # the version that generated a model turn; None for tool
    finish_reason: str = ""  # model turns: "stop" | "length"


@dataclass(frozen=True)
class Sample:
    prompt_index: int  # Prompt.index
    sample_index: int  # j in 0..n_samples_per_prompt-1
    prompt_ids: list[int]  # [P] token ids of the prompt (bos included)
    response_ids: list[int]  # [R] generated ids (eos included if generated); multi-turn: every turn
    response_logprobs: list[float]  # [R] engine logprob of each response id (0.0 on tool tokens)
    reward: float  # reward of the decoded response against the label
    weight_version: int  # version of the weights that generated it
    finish_reason: str  # "stop" | "length" | "abort"
    response_text: str = ""  # decoded response, for logs and debugging
    loss_mask: list[int] | None = None  # [R] 1 on the model's tokens, 0 on tool tokens; None: all 1
    turns: list[Turn] = field(default_factory=list)  # multi-turn: every turn in order; else []
    # [R] partial rollouts (rollout.partial): the version that generated each response id,
    # weight_version first; None: every token came from weight_version
    token_versions: list[int] | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.loss_mask is None and not self.turns:  # single-turn samples persist as before
            del data["loss_mask"], data["turns"]
        if self.token_versions is None:  # as before partial rollouts existed
            del data["token_versions"]
        return data

    @property
    def versions(self) -> list[int]:
        """The versions the response's tokens came from, oldest first."""
        return sorted(set(self.token_versions or [self.weight_version]))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Sample:
        turns = [Turn(**t) for t in data.get("turns") or []]
        return cls(**{**data, "turns": turns})


@dataclass(frozen=True)
class Retry:
    """One failed call of a prompt (``rollout.failures``), sent again."""

    prompt_index: int  # Prompt.index
    kind: str  # "infra" (another engine) | "data" (the row alone)
    turn: int  # the episode turn whose call failed
    engine: int  # the engine the call failed on
    attempt: int  # this prompt's failures of this kind so far
    error: str  # what failed, shortened


@dataclass(frozen=True)
class Drop:
    """A prompt past its failure budget: replaced by a spare prompt, or dropped."""

    prompt_index: int  # Prompt.index of the failed prompt
    kind: str  # the failure kind that exhausted it: "infra" | "data"
    attempts: int  # failures of that kind
    error: str  # the last failure, shortened
    replacement: int | None  # Prompt.index of the spare that took its place; None: dropped


@dataclass(frozen=True)
class FailureRecord:
    """Every retry and drop of one rollout (``rollout.failures``)."""

    retries: list[Retry] = field(default_factory=list)  # in the order they happened
    drops: list[Drop] = field(default_factory=list)  # in the order they were decided

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FailureRecord:
        return cls(
            retries=[Retry(**r) for r in data.get("retries") or []],
            drops=[Drop(**d) for d in data.get("drops") or []],
        )


@dataclass(frozen=True)
class SamplingRecord:
    """What dynamic sampling (``rollout.dynamic_sampling``) did for one batch."""

    rounds: int  # generation rounds run, the first included
    prompts: int  # prompts generated over all rounds
    dropped_groups: int  # groups whose rewards were all equal
    filled_uniform: int  # of those, put back because the rounds left the batch short
    # Mean reward of every sample of every round: the policy's own reward. The kept
    # batch's mean is not (the dropped groups were all wrong or all right). None in a
    # batch persisted before it was recorded.
    reward_mean_generated: float | None = None
    # Informative groups past the batch: a later round asks the gap over the keep
    # rate, so it may keep more than it needed. Generated, counted in the reward
    # above, not trained on (0 in a batch persisted before rounds over-asked).
    unused_groups: int = 0


@dataclass(frozen=True)
class RolloutBatch:
    iteration: int  # k: produced with weights v(k-1) for training step k
    n_samples_per_prompt: int  # group size; samples of one prompt are contiguous
    samples: list[Sample] = field(default_factory=list)  # [batch_size * n]
    sampling: SamplingRecord | None = None  # dynamic sampling's record; None when off
    failures: FailureRecord | None = None  # multi-turn: retries and drops; None when none
    # The temperature the samples were drawn at (rollout.temperature): the trainer scores
    # them under log_softmax(logits / temperature), the distribution the engines sampled
    # from and took their logprobs under. None: a batch persisted before it was recorded,
    # which the trainer scored at 1.0 and replays at 1.0 (the same bytes on resume).
    temperature: float | None = None

    @property
    def train_temperature(self) -> float:
        """The temperature the trainer scores this batch at."""
        return 1.0 if self.temperature is None else self.temperature

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["samples"] = [s.to_json() for s in self.samples]
        for key in ("sampling", "failures", "temperature"):  # absent records persist as before
            if data[key] is None:
                del data[key]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RolloutBatch:
        sampling, failures = data.get("sampling"), data.get("failures")
        return cls(
            iteration=int(data["iteration"]),
            n_samples_per_prompt=int(data["n_samples_per_prompt"]),
            samples=[Sample.from_json(s) for s in data["samples"]],
            sampling=SamplingRecord(**sampling) if sampling else None,
            failures=FailureRecord.from_json(failures) if failures else None,
            temperature=_temperature(data.get("temperature")),
        )

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


def _temperature(value: Any) -> float | None:
    """A persisted batch's temperature: None (not recorded) or a positive number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"rollout batch temperature {value!r} is not a positive number; the file is "
            "damaged: delete it and rerun rollout[k] to regenerate the batch"
        )
    return float(value)


@dataclass(frozen=True)
class Generated:
    """One generation round of the rollout procedure (``rollout.procedure``)."""

    batch: RolloutBatch  # the scored samples, ready to persist
    gen_s: float  # wall seconds the engines spent generating


@dataclass(frozen=True)
class Transition:
    """An environment's answer to one model turn (``rollout.environments``)."""

    observation: str  # text appended to the context before the next model turn ("" when done)
    reward: float  # reward of this step (shaping; the outcome reward is rollout.reward's)
    done: bool  # True: the episode ends with this turn
