"""verl's GRPO (``python -m verl.trainer.main_ppo``, SGLang rollouts) on the task of a
project config, timed and evaluated as the project is.

    python -m bench.peers.verl_grpo --iterations 20 --out verl.json   # configs/smollm2-gpu.yaml
    python -m bench.peers.verl_grpo --check                           # compose and validate only

The task goes to verl as two Parquet files: the training prompts in the
project's order (verl's shuffle off), and the project's held-out prompts as
verl's validation set. Each row carries its label and the project's reward
(``bench/peers/verl_reward.py``, verl's ``compute_score``). Given from the
config: the model, prompts per iteration, samples per prompt, new tokens,
temperature, top-p, lr, micro batch (``ppo_micro_batch_size_per_gpu``), no KL
(neither in the reward nor in the loss), one optimizer step per iteration
(``ppo_mini_batch_size`` = the batch). Also set, because the machine needs it:
one GPU and tensor-parallel 1, SGLang's triton attention and pytorch sampling
(the project's SGLang bundle has no FA3 kernels), sdpa attention in the trainer
and padding kept (no flash-attn wheel). Everything else is verl 0.9.1's
default: GRPO advantages normalized by the group's std, token-mean loss, clip
0.2, AdamW with weight decay 0.01, fp32 master weights computing in bf16,
gradient checkpointing, torch.compile, the hybrid engine (SGLang sleeps while
the trainer trains), the v1 trainer. ``--verl KEY=VALUE`` adds a Hydra
override (``--verl trainer.use_v1=false``: the legacy trainer, no TransferQueue).

verl evaluates with its own validation: greedy (temperature 0) on SGLang, on
the project's evaluation prompts through the model's chat template, scored by
the project's reward (``acc``: reward >= ``eval.pass_threshold``), before
training and every ``eval.interval`` iterations, outside its step timer. The
walls are verl's ``timing_s/step`` (rollout, logprobs, advantages, the update
and the weight sync to SGLang); ``gen_s`` is its ``timing_s/gen``. verl logs
no start-up time: it is read from the clock, as the arrival of the base
model's validation line less one validation (the median of the later ones).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.peers.task import ROOT, PeerTask, commit, load_task, machine, versions, write_result

PACKAGES = (
    "verl",
    "torch",
    "transformers",
    "sglang",
    "ray",
    "tensordict",
    "transferqueue",
    "hydra-core",
)
VAL_KEY = re.compile(r"^val-core/.+/acc/mean@1$")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/smollm2-gpu.yaml")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--verl", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    parser.add_argument("--log", default=None, help="copy verl's whole output here")
    parser.add_argument("--timeout", type=float, default=3600, help="stop verl after this")
    parser.add_argument("--check", action="store_true", help="compose and validate, no run")
    args = parser.parse_args()

    task = load_task(args.config, args.set, args.iterations)
    if not task.rollout.chat_template:
        raise SystemExit(
            "verl renders every prompt with the chat template: set rollout.chat_template"
        )
    work = Path(tempfile.mkdtemp(prefix="bench-verl-"))
    write_datasets(task, work)
    given = overrides(task, work)
    if args.check:
        check(given + args.verl)
        return
    result = run(task, given, args.verl, work, args.timeout, args.log)
    result.update(config=args.config, set=args.set, verl_set=args.verl)
    summarize(result)
    write_result(args.out, result)
    if result.get("error"):
        raise SystemExit(result["error"])


def write_datasets(task: PeerTask, work: Path) -> None:
    """train.parquet and val.parquet in verl's row format (prompt as chat messages)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def rows(prompts):
        return [
            {
                "data_source": task.rollout.task,
                "prompt": task.messages(p),
                "reward_model": {"style": "rule", "ground_truth": p.label},
                "extra_info": {
                    "index": p.index,
                    "reward": task.rollout.reward,
                    "trusted": ",".join(task.rollout.trusted_reward_modules),
                    "pass_threshold": task.eval.pass_threshold,
                },
            }
            for p in prompts
        ]

    pq.write_table(pa.Table.from_pylist(rows(task.train_prompts())), work / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows(task.eval_prompts())), work / "val.parquet")


def overrides(task: PeerTask, work: Path) -> list[str]:
    """The Hydra overrides that give verl the task (and what this machine needs)."""
    r = task.rollout
    samples = task.samples_per_iteration
    micro = min(task.micro_batch_size, samples)
    return [
        "algorithm.adv_estimator=grpo",
        f"algorithm.use_kl_in_reward={_flag(task.kl_coef > 0)}",
        f"data.train_files={work / 'train.parquet'}",
        f"data.val_files={work / 'val.parquet'}",
        "data.prompt_key=prompt",
        f"data.train_batch_size={r.batch_size}",
        "data.max_prompt_length=256",
        f"data.max_response_length={r.max_new_tokens}",
        "data.shuffle=false",
        f"actor_rollout_ref.model.path={task.model_path}",
        # no flash-attn wheel for this machine: sdpa, and padded batches (verl's
        # padding-free path calls flash-attn's varlen kernels)
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=false",
        f"actor_rollout_ref.actor.optim.lr={task.lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={r.batch_size}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.actor.use_kl_loss={_flag(task.kl_coef > 0)}",
        f"actor_rollout_ref.actor.kl_loss_coef={task.kl_coef}",
        "actor_rollout_ref.rollout.name=sglang",
        f"actor_rollout_ref.rollout.n={r.n_samples_per_prompt}",
        f"actor_rollout_ref.rollout.temperature={r.temperature}",
        f"actor_rollout_ref.rollout.top_p={r.top_p}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        # the project's SGLang bundle is trimmed of FA3 and sm100 kernels
        "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton",
        "+actor_rollout_ref.rollout.engine_kwargs.sglang.sampling_backend=pytorch",
        f"reward.custom_reward_function.path={ROOT / 'bench' / 'peers' / 'verl_reward.py'}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={task.iterations}",
        "trainer.total_epochs=1",
        f"trainer.test_freq={task.eval.interval}",
        f"trainer.val_before_train={_flag(task.evaluated(0))}",
        "trainer.save_freq=-1",
        "trainer.logger=[console,file]",
        "trainer.project_name=prefect-rl-peers",
        "trainer.experiment_name=verl-grpo",
        f"trainer.default_local_dir={work / 'checkpoints'}",
        f"hydra.run.dir={work / 'hydra'}",
    ]


def _flag(value: bool) -> str:
    return "true" if value else "false"


def check(given: list[str]) -> None:
    """Compose verl's config with these overrides and run verl's own validation of it,
    as ``main_ppo`` does before it starts Ray (every key must exist in verl 0.9.1)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    keys = [o for o in given if not o.startswith("hydra.")]
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=keys)
    validate_config(
        config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg)
    )
    a = cfg.actor_rollout_ref
    print(
        f"verl config composed and validated: {len(keys)} overrides; rollout {a.rollout.name} "
        f"n={a.rollout.n} T={a.rollout.temperature} tp={a.rollout.tensor_model_parallel_size}; "
        f"batch {cfg.data.train_batch_size} prompts, mini {a.actor.ppo_mini_batch_size}, micro "
        f"{a.actor.ppo_micro_batch_size_per_gpu}; lr {a.actor.optim.lr}; kl loss "
        f"{a.actor.use_kl_loss}; reference policy {need_reference_policy(cfg)}; critic "
        f"{need_critic(cfg)}; v1 trainer {cfg.trainer.use_v1}"
    )
    print(OmegaConf.to_yaml(OmegaConf.masked_copy(cfg, ["algorithm", "data"])))


def run(
    task: PeerTask,
    given: list[str],
    extra: list[str],
    work: Path,
    timeout: float,
    log_copy: str | None,
) -> dict[str, Any]:
    """verl as a subprocess; its per-step metrics (verl's file logger) stamped as they arrive."""
    metrics = work / "metrics.jsonl"
    log = work / "verl.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    env.update(VERL_FILE_LOGGER_PATH=str(metrics), HYDRA_FULL_ERROR="1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *given, *extra]
    print("verl:", " ".join(cmd[1:]), flush=True)
    arrivals: list[tuple[float, dict[str, Any]]] = []
    launched = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        read = 0
        while True:
            done = proc.poll() is not None
            read = _read_lines(metrics, read, arrivals)
            if done:
                break
            if time.perf_counter() - launched > timeout:
                os.killpg(proc.pid, signal.SIGTERM)  # verl and the Ray processes it started
                proc.wait(30)
                break
            time.sleep(0.2)
    total = time.perf_counter() - launched
    if log_copy:
        Path(log_copy).write_bytes(log.read_bytes())
    result = parse(arrivals, launched, task)
    result.update(
        system="verl",
        commit=commit(),
        command=" ".join(cmd[1:]),
        wall_total_s=total,
        returncode=proc.returncode,
        settings={
            **task.settings(),
            "given": given,
            "evaluation": "verl validation: greedy on SGLang",
        },
        versions=versions(PACKAGES),
        machine=machine(),
    )
    if proc.returncode != 0 or not result["rows"]:
        tail = log.read_text(errors="replace").splitlines()[-60:]
        result["error"] = f"verl exited {proc.returncode} after {total:.0f} s"
        result["log_tail"] = tail
        print("\n".join(tail))
    return result


def _read_lines(path: Path, offset: int, into: list[tuple[float, dict[str, Any]]]) -> int:
    """Append each complete new line of ``path`` (from byte ``offset``) with its arrival time."""
    if not path.is_file():
        return offset
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    now = time.perf_counter()
    whole = chunk[: chunk.rfind(b"\n") + 1]
    for line in whole.splitlines():
        if line.strip():
            into.append((now, json.loads(line)))
    return offset + len(whole)


def parse(arrivals: list[tuple[float, dict[str, Any]]], launched: float, task: PeerTask) -> dict:
    """The result file's rows and walls from verl's metric lines (``{"step", "data"}``)."""
    base, rows, walls = None, [], []
    base_at = first_at = None
    for at, line in arrivals:
        step, data = int(line["step"]), line["data"]
        val = next((v for k, v in data.items() if VAL_KEY.match(k)), None)
        if step == 0:
            base_at = at
            if val is not None:
                base = {"evaluated": True, "version": 0, "pass_at_1_greedy": val}
            continue
        timing = {k[len("timing_s/") :]: v for k, v in data.items() if k.startswith("timing_s/")}
        wall = timing.get("step")
        if wall is None:
            continue
        first_at = first_at or at
        walls.append(wall)
        row = {
            "iteration": step,
            "reward_mean": data.get("critic/score/mean"),
            "gen_s": timing.get("gen"),
            "train_s": wall - timing.get("gen", 0.0),
            "timing": timing,
            "response_length": data.get("response_length/mean"),
            "max_memory_allocated_gb": data.get("perf/max_memory_allocated_gb"),
        }
        if val is not None:
            row["eval_pass_at_1_greedy"] = val
            row["eval_s"] = timing.get("testing")
        rows.append(row)
    evals = [r["eval_s"] for r in rows if r.get("eval_s") is not None]
    one_eval = statistics.median(evals) if evals else 0.0
    if base_at is not None:
        startup = base_at - launched - one_eval
    elif first_at is not None:
        startup = first_at - launched - walls[0]
    else:
        startup = None
    if base is not None:
        base.update(prompts=task.eval.size, eval_s=one_eval)
    peaks = [r["max_memory_allocated_gb"] for r in rows if r["max_memory_allocated_gb"]]
    return {
        "startup_s": startup,
        "startup_note": "launch to the base model's validation line, less one validation",
        "base": base,
        "walls": walls,
        "rows": rows,
        "peak_gpu_memory_gb": max(peaks) if peaks else None,
        "peak_gpu_memory_note": "verl's perf/max_memory_allocated_gb: the trainer's side",
    }


def summarize(result: dict[str, Any]) -> None:
    print(f"{'k':>3} {'reward':>7} {'pass@1 greedy':>14} {'wall s':>7} {'gen s':>6} {'train s':>7}")
    if result["base"]:
        print(f"{0:>3} {'':>7} {result['base']['pass_at_1_greedy']:>14.3f}  (base)")
    for r in result["rows"]:
        greedy = r.get("eval_pass_at_1_greedy")
        print(
            f"{r['iteration']:>3} {r['reward_mean'] or 0:>7.3f} "
            f"{'' if greedy is None else f'{greedy:.3f}':>14} {r['timing']['step']:>7.2f} "
            f"{r['gen_s'] or 0:>6.2f} {r['train_s']:>7.2f}"
        )
    if result["walls"]:
        steady = result["walls"][1:] or result["walls"]
        print(
            f"start-up {result['startup_s'] or float('nan'):.1f} s; iteration wall median "
            f"{statistics.median(steady):.2f} s after the first"
        )


if __name__ == "__main__":
    main()
