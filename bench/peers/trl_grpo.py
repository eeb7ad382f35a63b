"""TRL's GRPOTrainer on the task of a project config, timed and evaluated as the project is.

    python -m bench.peers.trl_grpo --iterations 20 --out trl.json     # configs/smollm2-gpu.yaml

One iteration is one generation batch and one optimizer step: the config's
``rollout.batch_size`` prompts in the project's order (TRL's shuffle off) x
``n_samples_per_prompt`` completions, ``train.micro_batch_size`` completions
per forward/backward (the rest as gradient accumulation). Given from the
config: the model (loaded by TRL, fp32 weights), ``max_new_tokens``,
``temperature``, ``top_p``, ``lr`` (constant, as the project's), the KL
coefficient (``beta``) and the reward (the project's, through
``task.PeerTask.rewards``). Everything else is TRL 1.16's default: loss
``dapo``, group-scaled advantages, clip 0.2, bf16 autocast on CUDA, gradient
checkpointing, generation by transformers. ``--trl KEY=VALUE`` overrides a
GRPOConfig field (the value parsed as YAML).

The clock: start-up runs from this module's import to the trainer's first
step (imports, model load, trainer set-up; the evaluation's model copy left
out); an iteration's wall runs from the end of the one before, CUDA
synchronized, with every evaluation left out; ``gen_s`` is the part in TRL's
``_generate_and_score_completions``. The evaluations (the base model before
iteration 1, then every ``eval.interval``) run greedy on a bf16 copy of the
policy's weights (fp32 on CPU) through ``task.greedy_evaluation``.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before torch, transformers and TRL are imported

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import yaml  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from bench.peers.task import (  # noqa: E402
    PeerTask,
    commit,
    greedy_evaluation,
    load_task,
    machine,
    versions,
    write_result,
)

PACKAGES = ("torch", "transformers", "trl", "accelerate", "datasets")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/smollm2-gpu.yaml")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--trl", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--eval-batch", type=int, default=256, help="prompts per generate call")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args()

    task = load_task(args.config, args.set, args.iterations)
    result = run(task, dict(_field(s) for s in args.trl), args.eval_batch)
    result.update(config=args.config, set=args.set, trl_set=args.trl)
    summarize(result)
    write_result(args.out, result)


def run(task: PeerTask, overrides: dict[str, Any], eval_batch: int) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    samples = task.samples_per_iteration
    micro = min(task.micro_batch_size, samples)
    if samples % micro:
        raise SystemExit(f"train.micro_batch_size {micro} does not divide {samples} samples")
    rows = [{"prompt": task.messages(p), "label": p.label} for p in task.train_prompts()]

    def reward(completions: list, label: list[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return task.rewards(texts, label)

    reward.__name__ = task.rollout.reward  # TRL logs it as rewards/<name>/mean
    given = {
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": samples // micro,
        "num_generations": task.rollout.n_samples_per_prompt,
        "max_completion_length": task.rollout.max_new_tokens,
        "temperature": task.rollout.temperature,
        "top_p": task.rollout.top_p,
        "learning_rate": task.lr,
        "lr_scheduler_type": "constant",
        "beta": task.kl_coef,
        "max_steps": task.iterations,
        "shuffle_dataset": False,
        "seed": task.seed,
    }
    plumbing = {"logging_steps": 1, "save_strategy": "no", "report_to": "none"}
    if not cuda:
        plumbing["bf16"] = False  # TRL's default bf16 autocast is for accelerators
    workdir = tempfile.mkdtemp(prefix="bench-trl-")
    grpo = GRPOConfig(output_dir=workdir, **given, **plumbing, **overrides)

    clock = Clock(task, cuda, eval_batch)
    trainer = TimedGRPOTrainer(
        model=task.model_path,
        reward_funcs=reward,
        args=grpo,
        train_dataset=Dataset.from_list(rows),
        callbacks=[clock],
    )
    clock.trainer = trainer
    # The evaluation's own copy of the model: bench overhead, kept out of TRL's start-up.
    t0 = _now()
    eval_dtype = torch.bfloat16 if cuda else torch.float32
    clock.eval_model = (
        AutoModelForCausalLM.from_pretrained(task.model_path, dtype=eval_dtype)
        .to(trainer.accelerator.device)
        .eval()
    )
    clock.not_startup = _now() - t0
    trainer.train()

    return {
        "system": "trl",
        "commit": commit(),
        "settings": {
            **task.settings(),
            "given": given,
            # TRL's defaults unless --trl set them
            "trl_values": {
                key: getattr(grpo, key)
                for key in (
                    "loss_type",
                    "scale_rewards",
                    "epsilon",
                    "epsilon_high",
                    "num_iterations",
                    "bf16",
                    "gradient_checkpointing",
                    "weight_decay",
                    "max_grad_norm",
                    "top_k",
                    "use_vllm",
                )
            },
            "trl_set": overrides,
            "evaluation": f"greedy, transformers generate on a {str(eval_dtype)[6:]} copy",
        },
        "startup_s": clock.startup_s,
        "base": clock.base,
        "walls": clock.walls,
        "rows": clock.rows,
        "peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "wall_total_s": time.perf_counter() - STARTED,
        "versions": versions(PACKAGES),
        "machine": machine(),
    }


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that adds up the seconds of its generation batches (generation,
    rewards and whatever TRL computes with them) in ``gen_s``."""

    gen_s = 0.0

    def _generate_and_score_completions(self, inputs):
        t0 = _now()
        out = super()._generate_and_score_completions(inputs)
        self.gen_s += _now() - t0
        return out


def _now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


class Clock(TrainerCallback):
    """Times each iteration, evaluates where the project does, and keeps the rows."""

    def __init__(self, task: PeerTask, cuda: bool, eval_batch: int):
        self.task, self.cuda, self.eval_batch = task, cuda, eval_batch
        self.trainer: Any = None
        self.eval_model: Any = None
        self.startup_s: float | None = None
        self.not_startup = 0.0  # seconds before the first step that are the bench's own
        self.base: dict[str, Any] | None = None
        self.walls: list[float] = []
        self.rows: list[dict[str, Any]] = []
        self.since = 0.0  # start of the iteration being timed
        self.gen_before = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.startup_s = _now() - STARTED - self.not_startup
        if self.task.evaluated(0):
            self.base = self.evaluate(0)
            print(f"base model: greedy pass@1 {self.base['pass_at_1_greedy']:.3f}")
        self.since = _now()

    def on_step_end(self, args, state, control, **kwargs):
        end = _now()
        k = state.global_step
        gen = self.trainer.gen_s - self.gen_before
        self.gen_before = self.trainer.gen_s
        self.walls.append(end - self.since)
        row: dict[str, Any] = {
            "iteration": k,
            "gen_s": gen,
            "train_s": end - self.since - gen,
        }
        if self.task.evaluated(k):
            result = self.evaluate(k)
            row["eval_pass_at_1_greedy"] = result["pass_at_1_greedy"]
            row["eval_s"] = result["eval_s"]
            row["eval_example"] = result["example"]
        self.rows.append(row)
        self.since = _now()

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Logged after on_step_end of the same step: the batch's reward and lengths.
        if logs and self.rows and "reward" in logs:
            self.rows[-1]["reward_mean"] = logs["reward"]
            self.rows[-1]["completion_length"] = logs.get("completions/mean_length")

    def evaluate(self, k: int) -> dict[str, Any]:
        policy = self.trainer.accelerator.unwrap_model(self.trainer.model)
        self.eval_model.load_state_dict(policy.state_dict())
        return greedy_evaluation(
            self.task, self.eval_model, self.trainer.processing_class, k, self.eval_batch
        )


def summarize(result: dict[str, Any]) -> None:
    """One line per iteration, then the medians."""
    print(f"{'k':>3} {'reward':>7} {'pass@1 greedy':>14} {'wall s':>7} {'gen s':>6} {'train s':>7}")
    if result["base"]:
        print(f"{0:>3} {'':>7} {result['base']['pass_at_1_greedy']:>14.3f}  (base)")
    for r, wall in zip(result["rows"], result["walls"]):
        greedy = r.get("eval_pass_at_1_greedy")
        print(
            f"{r['iteration']:>3} {r.get('reward_mean', float('nan')):>7.3f} "
            f"{'' if greedy is None else f'{greedy:.3f}':>14} {wall:>7.2f} "
            f"{r['gen_s']:>6.2f} {r['train_s']:>7.2f}"
        )
    steady = result["walls"][1:] or result["walls"]
    print(
        f"start-up {result['startup_s']:.1f} s; iteration wall median {statistics.median(steady):.2f} s "
        f"after the first; peak GPU memory {result['peak_gpu_memory_gb'] or 0:.1f} GB"
    )


def _field(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise SystemExit(
            f"--trl {item!r}: expected FIELD=VALUE, e.g. --trl gradient_checkpointing=false"
        )
    key, raw = item.split("=", 1)
    return key.strip(), yaml.safe_load(raw)


if __name__ == "__main__":
    main()
