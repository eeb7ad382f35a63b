"""Wire objects of the rollout step: prompts, samples and the persisted batch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Prompt:
    index: int  # position in the task's dataset; seeds sampling with (seed, k, index, j)
    text: str  # the prompt as text
    label: str  # reference answer the reward compares against


@dataclass(frozen=True)
class Sample:
    prompt_index: int  # Prompt.index
    sample_index: int  # j in 0..n_samples_per_prompt-1
    prompt_ids: list[int]  # [P] token ids of the prompt (bos included)
    response_ids: list[int]  # [R] generated ids (eos included if generated)
    response_logprobs: list[float]  # [R] engine logprob of each response id
    reward: float  # reward of the decoded response against the label
    weight_version: int  # version of the weights that generated it
    finish_reason: str  # "stop" | "length" | "abort"
    response_text: str = ""  # decoded response, for logs and debugging


@dataclass(frozen=True)
class SamplingRecord:
    """What dynamic sampling (``rollout.dynamic_sampling``) did for one batch."""

    rounds: int  # generation rounds run, the first included
    prompts: int  # prompts generated over all rounds
    dropped_groups: int  # groups whose rewards were all equal
    filled_uniform: int  # of those, put back because the rounds left the batch short


@dataclass(frozen=True)
class RolloutBatch:
    iteration: int  # k: produced with weights v(k-1) for training step k
    n_samples_per_prompt: int  # group size; samples of one prompt are contiguous
    samples: list[Sample] = field(default_factory=list)  # [batch_size * n]
    sampling: SamplingRecord | None = None  # dynamic sampling's record; None when off

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.sampling is None:  # batches without dynamic sampling persist as before
            del data["sampling"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RolloutBatch:
        sampling = data.get("sampling")
        return cls(
            iteration=int(data["iteration"]),
            n_samples_per_prompt=int(data["n_samples_per_prompt"]),
            samples=[Sample(**s) for s in data["samples"]],
            sampling=SamplingRecord(**sampling) if sampling else None,
        )

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]
