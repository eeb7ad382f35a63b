"""The task a peer trains, read from a project config, and the evaluation that scores it.

Everything a peer must match comes from the project's own code, imported
without Prefect, Ray or the engines: the config (``flows.config.load_config``,
the same ``--set``), the training prompts in the project's order
(``rollout.datasets.PromptSource``: batch k is the project's batch k), the
held-out prompts (``rollout.evaluation.eval_prompts``: the same 256 additions
the project evaluates), their encoding (``rollout.datasets.encode_prompt``)
and the reward (``rollout.rewards``). The greedy evaluation goes through the
project's rollout procedure (``rollout.procedure.generate_batch``) with
transformers' ``generate`` behind its ``GenerateGroups``, so a peer's answers
are encoded, decoded and scored exactly as the project's are; only the
generating engine differs (the project's is SGLang).

A result file has the keys of ``bench.smollm2_learning``'s (``config``,
``set``, ``base``, ``walls``, ``rows``: one per iteration with ``reward_mean``
and, where evaluated, ``eval_pass_at_1_greedy``) plus ``system``, ``settings``
(what the peer was given, and its defaults that differ from the project's),
``startup_s``, ``versions`` and ``machine``. ``walls`` are each iteration's
seconds with the evaluations left out.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.config import RolloutConfig
from rollout.datasets import PromptSource
from rollout.evaluation import EvalConfig, due, eval_prompts
from rollout.procedure import generate_batch
from rollout.rewards import score
from rollout.types import Prompt

ROOT = Path(__file__).resolve().parents[2]  # the project root, for subprocesses and reward files


@dataclass(frozen=True)
class PeerTask:
    """What every system trains: one project config, ``iterations`` batches of it."""

    config: str  # the project config file the task was read from
    sets: tuple[str, ...]  # its --set overrides, KEY=VALUE
    iterations: int  # batches trained (one optimizer step each)
    seed: int  # run.seed: which prompts the task makes
    model_path: str  # the base model, a local HF folder
    rollout: RolloutConfig  # task, batch, samples, sampling, reward
    eval: EvalConfig  # held-out prompts and how often they are scored
    lr: float  # train.lr
    micro_batch_size: int  # train.micro_batch_size: samples per forward/backward
    kl_coef: float  # train.loss.kl_coef

    @property
    def samples_per_iteration(self) -> int:
        return self.rollout.batch_size * self.rollout.n_samples_per_prompt

    def train_prompts(self) -> list[Prompt]:
        """Batches 1..iterations in order: the prompts the project trains on."""
        source = PromptSource(self.rollout, self.seed)
        return [p for k in range(1, self.iterations + 1) for p in source.batch(k)]

    def eval_prompts(self) -> list[Prompt]:
        return eval_prompts(self.eval, self.rollout, self.seed)

    def messages(self, prompt: Prompt) -> list[dict[str, str]] | str:
        """A prompt as a peer takes it: the user turn of the chat template, or raw text."""
        if self.rollout.chat_template:
            return [{"role": "user", "content": prompt.text}]
        return prompt.text

    def rewards(self, responses: Sequence[str], labels: Sequence[str]) -> list[float]:
        """The project's reward of each response (``rollout.reward``, scored as the project does)."""
        items = [{"response": r, "label": lab} for r, lab in zip(responses, labels, strict=True)]
        return score(self.rollout, items)

    def evaluated(self, k: int) -> bool:
        """Whether the project evaluates after iteration k (k = 0: the base model)."""
        return due(self.eval, k, self.iterations)

    def settings(self) -> dict[str, Any]:
        """What every system is given, for the result file."""
        return {
            "model": self.model_path,
            "task": self.rollout.task,
            "chat_template": self.rollout.chat_template,
            "reward": self.rollout.reward,
            "prompts_per_iteration": self.rollout.batch_size,
            "samples_per_prompt": self.rollout.n_samples_per_prompt,
            "max_new_tokens": self.rollout.max_new_tokens,
            "temperature": self.rollout.temperature,
            "top_p": self.rollout.top_p,
            "lr": self.lr,
            "kl_coef": self.kl_coef,
            "eval_prompts": self.eval.size,
            "eval_interval": self.eval.interval,
        }


def load_task(config: str, sets: Sequence[str], iterations: int) -> PeerTask:
    """The task of a project config with ``--set`` overrides applied, as the project reads it."""
    from flows.config import load_config, parse_override

    overrides = dict(parse_override(s) for s in sets)
    overrides["run.iterations"] = iterations
    cfg = load_config(config, overrides)
    if not cfg.model.path:
        raise SystemExit(
            f"{config}: model.path is unset (the project's tiny model); give a local HF folder, "
            "e.g. --set model.path=/tmp/tiny after `python -m flows.cli tiny-model /tmp/tiny`"
        )
    if cfg.rollout.environment != "none":
        raise SystemExit("the peers bench runs single-turn tasks only; rollout.environment is set")
    return PeerTask(
        config=config,
        sets=tuple(sets),
        iterations=iterations,
        seed=cfg.run.seed,
        model_path=str(Path(cfg.model.path).expanduser()),
        rollout=cfg.rollout,
        eval=cfg.eval,
        lr=cfg.train.lr,
        micro_batch_size=cfg.train.micro_batch_size,
        kl_coef=cfg.train.loss.kl_coef,
    )


class GreedyGenerate:
    """``GenerateGroups`` over transformers' ``generate``: greedy, one answer per prompt.

    Prompts are left-padded into batches of ``batch``; each answer ends at its first
    end-of-sequence token (kept, as SGLang keeps it) or at ``max_new_tokens``.
    Logprobs are not computed (0.0): evaluation reads only the rewards."""

    def __init__(self, model: Any, tokenizer: Any, version: int, batch: int = 256):
        self.model, self.tokenizer, self.version, self.batch = model, tokenizer, version, batch
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(tokenizer.eos_token_id)
        self.eos = eos
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]

    def __call__(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: dict[str, Any],
        seeds: list[list[int]],
        restart_fn: Callable[[int], None] | None = None,
    ) -> list[list[dict[str, Any]]]:
        if n != 1 or sampling["temperature"] != 0:
            raise ValueError("GreedyGenerate answers greedy evaluation only (temperature 0, n 1)")
        out: list[list[dict[str, Any]]] = []
        for start in range(0, len(prompts), self.batch):
            out.extend(
                [answer] for answer in self._batch(prompts[start : start + self.batch], sampling)
            )
        return out

    def _batch(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[dict[str, Any]]:
        import torch
        from transformers import GenerationConfig

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        device = next(self.model.parameters()).device
        gen = GenerationConfig(
            max_new_tokens=sampling["max_new_tokens"],
            do_sample=False,
            pad_token_id=self.pad,
            eos_token_id=self.eos,
        )
        with torch.no_grad():
            full = self.model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen
            )
        answers = []
        for row in full[:, width:].tolist():
            stop = next((j for j, t in enumerate(row) if t in self.eos), None)
            tokens = row if stop is None else row[: stop + 1]
            answers.append(
                {
                    "output_ids": tokens,
                    "meta_info": {
                        "weight_version": str(self.version),
                        "finish_reason": {"type": "length" if stop is None else "stop"},
                        "output_token_logprobs": [[0.0, t, None] for t in tokens],
                    },
                }
            )
        return answers


def greedy_evaluation(
    task: PeerTask, model: Any, tokenizer: Any, k: int, batch: int = 256
) -> dict[str, Any]:
    """Held-out greedy pass@1 of ``model`` after iteration k, on the project's evaluation
    prompts, encoded and scored by the project's rollout procedure."""
    prompts = task.eval_prompts()
    greedy = task.rollout.model_copy(update={"temperature": 0.0, "n_samples_per_prompt": 1})

    def no_restart(engine: int) -> None:
        raise RuntimeError("transformers generate has no engine to restart")

    t0 = time.perf_counter()
    out = generate_batch(
        greedy,
        task.seed,
        k,
        k,
        tokenizer,
        GreedyGenerate(model, tokenizer, k, batch),
        no_restart,
        prompts=prompts,
    )
    passed = sum(s.reward >= task.eval.pass_threshold for s in out.batch.samples)
    return {
        "evaluated": True,
        "version": k,
        "prompts": len(prompts),
        "pass_at_1_greedy": passed / len(prompts),
        "eval_s": time.perf_counter() - t0,
        "example": out.batch.samples[0].response_text,
    }


def versions(packages: Sequence[str]) -> dict[str, str | None]:
    """Installed version of each package, as this process imports it (None: absent)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def machine() -> dict[str, Any]:
    """The card and host a result was measured on."""
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = props.name
            info["gpu_memory_gb"] = round(props.total_memory / 2**30, 1)
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    info.setdefault("gpu", None)
    return info


def commit() -> str | None:
    """The project's commit, where the working tree is a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def write_result(path: str | None, result: dict[str, Any]) -> None:
    """Write a result as JSON to ``path`` (nothing when None)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {path}")
