"""Trainer step at RL shapes: ``TrainActor.train_step`` beside a plain PyTorch loop.

Owns this measurement and nothing else: it never changes trainer code, and the
trainer runs with the shape's ``micro_batch_size`` and then exactly the settings
of ``--set`` / ``--variants``. One rank, no Ray: it measures the step, not the
orchestration.

For each shape and variant it writes random-init weights and random rollouts
(a local run store), builds a ``TrainActor`` (or ``MegatronTrainActor``), and
alternates its ``train_step(k)`` with a plain PyTorch step over the same
micro-batches of the same tokens, so machine noise hits both. Round 1 warms
up; figures are medians of ``--repeats`` rounds.

The plain loop is what a user would write by hand: the HF model with fp32
master weights under ``torch.autocast(bfloat16)`` on CUDA (fp32, no autocast
on CPU), next-token logprob by ``log_softmax(logits.float())`` + gather at
temperature 1, ``-(adv * logp)`` over response tokens, ``clip_grad_norm_``,
``AdamW`` (fused on CUDA, foreach on CPU), TF32 on and no deterministic
algorithms. The trainer keeps the global flags its ``setup`` and
``init_from_base`` left (each row's ``trainer_flags``); each side's flags are
set before its step.

Figures per row:
- tokens/step: attention tokens (prompt + response) of every sample.
- step s: wall seconds of one step, synchronized before the clock stops.
- MFU: 6 * N * tokens / step s / peak. N = ``model.num_parameters()``
  (embeddings included; an untied input embedding does no matmul, so small
  untied models are flattered). 6N per token = forward 2N + backward 4N:
  on-policy the trainer runs no separate old-logprob forward (the ratio's old
  side is its training forward, detached), and ``train.loss.kl_coef`` > 0 adds
  a reference forward that is not credited. Attention's T^2 term is left out.
  Peak: ``--peak-tflops`` (989: H100 SXM bf16 dense; its TF32 dense is 495).
- peak GiB: ``torch.cuda.max_memory_allocated`` over the step (reset before
  it) less the other side's resident weights, grads and optimizer state, as
  both live in this process; None on CPU.
- plain/step: plain s / step s; above 1 the trainer is faster.

    python -m bench.train [--shape tiny,qwen2-19m] [--set train.KEY=VALUE ...]
        [--variants "LABEL:train.a=1,model.b=x" ...] [--repeats 3] [--profile]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import re
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers
import yaml
from pydantic import ValidationError
from transformers import AutoConfig, AutoModelForCausalLM

from rollout.types import RolloutBatch, Sample
from storage.config import StorageConfig
from storage.run_store import RunStore
from training.batch import TrainBatch, build_train_batch, rank_micro_batches
from training.config import ModelConfig, RunIdentity, TrainConfig, TrainerSections, WeightsConfig
from training.group import actor_class
from training.qwen2_shape import write_qwen2_05b
from training.tiny_model import write_tiny_model

GIB = 2**30
Rounds = list[tuple[float, int | None]]  # (seconds, peak CUDA bytes) of each round


def write_qwen2(out: Path) -> Path:
    """A ~19M-parameter random-init Qwen2 (no tokenizer: train_step needs none)."""
    cfg = transformers.Qwen2Config(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out


def write_smollm2(out: Path) -> Path:
    """SmolLM2-135M's shape (``configs/smollm2-gpu.yaml``), random init, bf16 on disk."""
    cfg = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        rope_theta=100_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    return out


@dataclass(frozen=True)
class Shape:
    write: Callable[[Path], Path]  # writes the HF model directory
    prompts: int  # prompts per step
    n: int  # samples per prompt
    prompt_len: int  # tokens per prompt, bos included
    response_len: int  # tokens per response
    micro_batch_size: int  # train.micro_batch_size unless --set
    gpu_only: bool = False  # minutes per step on CPU: refused there without --force


SHAPES = {
    "tiny": Shape(write_tiny_model, 8, 4, 16, 48, 8),
    "qwen2-19m": Shape(write_qwen2, 8, 4, 16, 48, 8),
    "smollm2-gpu": Shape(write_smollm2, 64, 8, 40, 48, 64, gpu_only=True),
    "qwen2-0.5b": Shape(write_qwen2_05b, 32, 8, 32, 224, 16, gpu_only=True),
}


def rollouts(
    k: int,
    vocab: int,
    prompts: int,
    n: int,
    prompt_len: int,
    response_len: int,
    alternate: bool = False,
) -> RolloutBatch:
    """A GRPO batch of random tokens for iteration ``k`` (its own seed). Rewards are
    random, or with ``alternate`` 0, 1, 0, ... within each prompt's group, so that every
    group has a non-zero advantage (as a learning run's batches do)."""
    rng = random.Random(k)

    def sample(p: int, j: int) -> Sample:
        prompt = [1] + [rng.randrange(4, vocab) for _ in range(prompt_len - 1)]
        response = [rng.randrange(4, vocab) for _ in range(response_len)]
        reward = float(j % 2) if alternate else float(rng.random() < 0.5)
        return Sample(p, j, prompt, response, [-1.0] * response_len, reward, k - 1, "length")

    return RolloutBatch(k, n, [sample(p, j) for p in range(prompts) for j in range(n)])


def parse_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """``train.a.b=VALUE`` / ``model.a=VALUE`` items as nested dicts per section,
    values read as YAML; later items win."""
    out: dict[str, dict[str, Any]] = {"train": {}, "model": {}}
    for item in items:
        key, sep, value = item.partition("=")
        section, *path = key.strip().split(".")
        if not sep or section not in out or not path:
            raise SystemExit(f"--set {item!r}: write train.KEY=VALUE or model.KEY=VALUE")
        node = out[section]
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = yaml.safe_load(value)
    return out


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """``LABEL:train.a=1,model.b=x`` as (label, overrides); a comma starts a new
    override only before ``train.`` or ``model.``, so YAML values may hold commas."""
    label, sep, rest = spec.partition(":")
    if not sep or not label.strip():
        raise SystemExit(f"--variants {spec!r}: write LABEL:train.KEY=VALUE[,model.KEY=VALUE]")
    return label.strip(), [s for s in re.split(r",(?=\s*(?:train|model)\.)", rest) if s.strip()]


def trainer_sections(
    shape: Shape, overrides: list[str], label: str, root: Path, device: str
) -> TrainerSections:
    """The bench's trainer defaults for ``shape`` with ``overrides`` on top; pydantic
    rejects unknown keys and bad values (the config's own checks)."""
    sets = parse_overrides(overrides)
    train = {
        "micro_batch_size": shape.micro_batch_size,
        "torch_threads": torch.get_num_threads(),
        "num_gpus_per_worker": 1.0 if device == "cuda" else 0.0,
        **sets["train"],
    }
    try:
        return TrainerSections(
            train=TrainConfig(**train),
            model=ModelConfig(**sets["model"]),
            storage=StorageConfig(root=str(root)),
            weights=WeightsConfig(),
        )
    except ValidationError as err:
        raise SystemExit(f"variant {label!r} ({' '.join(overrides)}): {err}") from None


class PlainLoop:
    """The hand-written mixed-precision step (see the module doc)."""

    def __init__(self, path: Path, device: torch.device) -> None:
        self.device, cuda = device, device.type == "cuda"
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa"
        ).to(device)
        self.optim = torch.optim.AdamW(
            self.model.parameters(), lr=1e-6, fused=cuda or None, foreach=not cuda or None
        )
        self.autocast = (lambda: torch.autocast("cuda", torch.bfloat16)) if cuda else nullcontext

    def step(self, mbs: list[TrainBatch]) -> None:
        self.model.train()
        loss_tokens = sum(float(mb.loss_mask.sum()) for mb in mbs)
        for mb in mbs:
            ids, am = mb.input_ids.to(self.device), mb.attention_mask.to(self.device)
            mask, adv = mb.loss_mask.to(self.device), mb.advantages.to(self.device)
            with self.autocast():
                logits = self.model(input_ids=ids, attention_mask=am, use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
            (-(adv[:, None] * logp * mask).sum() / loss_tokens).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)


FLAG_NAMES = ("deterministic", "deterministic_warn_only", "tf32_matmul", "tf32_cudnn")


def global_flags() -> tuple:
    """The process-wide switches the two sides set differently (``FLAG_NAMES``)."""
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )


def set_flags(flags: tuple) -> None:
    deterministic, warn_only, tf32_matmul, tf32_cudnn = flags
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.backends.cuda.matmul.allow_tf32 = tf32_matmul
    torch.backends.cudnn.allow_tf32 = tf32_cudnn


TORCH_DEFAULTS = global_flags()  # as torch starts, before any actor's setup()
PLAIN_FLAGS = (False, False, True, True)  # no deterministic algorithms, TF32 on


def resident_bytes(*objs: Any) -> int:
    """CUDA bytes of these modules' parameters and grads and optimizers' state."""
    tensors: list[torch.Tensor | None] = []
    for obj in objs:
        if isinstance(obj, torch.optim.Optimizer):
            tensors += [v for st in obj.state.values() for v in st.values() if torch.is_tensor(v)]
        elif obj is not None:
            tensors += [t for p in obj.parameters() for t in (p, p.grad)]
    # FSDP2 (train.compute_dtype, more ranks) holds DTensors: count their local shards.
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local if t.is_cuda
    }
    return sum(storages.values())


def timed(step: Callable[[], object], flags: tuple, cuda: bool) -> tuple[float, int | None]:
    """Seconds of one ``step()`` under ``flags`` and its peak allocated CUDA bytes."""
    set_flags(flags)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, (torch.cuda.max_memory_allocated() if cuda else None)


def bench_row(
    name: str, path: Path, label: str, sections: TrainerSections, args: argparse.Namespace
) -> dict[str, Any]:
    """One row: the trainer of ``sections`` and the plain loop over rollouts 1.. of ``name``."""
    cuda = args.device == "cuda"
    set_flags(TORCH_DEFAULTS)  # the previous row's plain flags must not reach setup()
    identity = RunIdentity(name=name, seed=0, namespace="prefect-rl")
    actor = actor_class(sections.train.backend)(identity, sections, 0, "127.0.0.1", 0)
    actor.setup()
    actor.init_from_base(str(path))
    trainer_flags = global_flags()
    if args.nondeterministic:  # what torch's deterministic algorithms cost the step
        trainer_flags = (False, False, *trainer_flags[2:])
    plain = PlainLoop(path, torch.device(args.device))
    store = RunStore(sections.storage, name)
    mbs = {}  # the trainer's own micro-batches of each round, for the plain loop
    for k in range(1, args.repeats + 2):
        full = build_train_batch(
            RolloutBatch.from_json(store.read_rollouts(k)), actor.pad_id, sections.train.loss
        )
        mbs[k] = rank_micro_batches(full, 0, 1, sections.train)
    step: Rounds = []
    base: Rounds = []
    plain_error = None  # the plain loop's full log-softmax may not fit where the trainer does
    for k in mbs:  # which side goes first alternates too
        for side in ("trainer", "plain") if k % 2 else ("plain", "trainer"):
            if side == "trainer":
                step.append(timed(partial(actor.train_step, k), trainer_flags, cuda))
            elif plain_error is None:
                try:
                    base.append(timed(partial(plain.step, mbs[k]), PLAIN_FLAGS, cuda))
                except torch.OutOfMemoryError as e:
                    plain_error = "out of memory: " + str(e).split(". ")[0]
                    print(f"{name} / {label}: the plain loop ran {plain_error}; the row goes on")
                    base = []
                    plain.model.zero_grad(set_to_none=True)
                    gc.collect()
                    torch.cuda.empty_cache()
    if args.profile:
        set_flags(trainer_flags)
        trace = args.trace and str(Path(args.trace) / f"{name}-{label}.json")
        print_profile(f"{name} / {label}", partial(actor.train_step, args.repeats + 2), trace)
    peaks = (None, None)
    if cuda:  # each side's peak less the other side's resident state
        peaks = (
            max(p for _, p in step[1:]) - resident_bytes(plain.model, plain.optim),
            max(p for _, p in base[1:]) - resident_bytes(actor.model, actor.ref_model, actor.optim)
            if base
            else None,
        )
    params = plain.model.num_parameters()
    actor = plain = None  # free device memory before the next row
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    row = {"shape": name, "variant": label, "params": params, "micro_batches": len(mbs[1])}
    row |= figures(params, int(full.attention_mask.sum()), step, base, peaks, args.peak_tflops)
    row["plain_error"] = plain_error
    row["trainer_flags"] = dict(zip(FLAG_NAMES, trainer_flags))
    row["train_config"] = sections.train.model_dump(mode="json", exclude_defaults=True)
    row["model_config"] = sections.model.model_dump(mode="json", exclude_defaults=True)
    return row


def figures(
    params: int, tokens: int, step: Rounds, base: Rounds, peaks: tuple, peak_tflops: float | None
) -> dict[str, Any]:
    """A row's figures from the (seconds, peak bytes) of each round, round 1 dropped."""
    step_s = statistics.median(s for s, _ in step[1:])
    plain_s = statistics.median(s for s, _ in base[1:]) if base else None  # None: it failed
    flops = 6 * params * tokens / (peak_tflops * 1e12) if peak_tflops else None
    return {
        "tokens_per_step": tokens,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "mfu": flops / step_s if flops else None,
        "peak_mem_gib": None if peaks[0] is None else peaks[0] / GIB,
        "plain_s": plain_s,
        "plain_tokens_per_s": tokens / plain_s if plain_s else None,
        "plain_mfu": flops / plain_s if flops and plain_s else None,
        "plain_peak_mem_gib": None if peaks[1] is None else peaks[1] / GIB,
        "plain_over_step": plain_s / step_s if plain_s else None,
        "step_s_rounds": [s for s, _ in step],
        "plain_s_rounds": [s for s, _ in base],
    }


def print_profile(title: str, step: Callable[[], object], trace: str | None) -> None:
    """One ``step()`` under torch.profiler: its wall seconds beside the seconds the
    device was busy (far apart means the host, not the kernels, sets the pace), then
    the top operators by device time and by host time; ``trace`` writes the Chrome
    trace there."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    averages = prof.key_averages()
    print(f"\nprofile of one train step: {title}")
    if cuda:
        busy = sum(getattr(e, "self_device_time_total", 0) for e in averages) / 1e6
        launches = sum(e.count for e in averages if getattr(e, "self_device_time_total", 0))
        print(
            f"wall {wall:.3f} s, device busy {busy:.3f} s ({busy / wall:.0%}), {launches} kernels"
        )
        print(
            averages.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60)
        )
    print(averages.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    if trace:
        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(trace)
        print(f"wrote {trace}")


def matmul_tflops(shapes: tuple[tuple[int, int, int], ...]) -> dict[str, float]:
    """bf16 TFLOP/s of one GEMM per (m, k, n) on this card: what MFU can reach here
    (cards of one kind differ in clocks and power limits)."""
    out = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        reps = 50
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        torch.cuda.synchronize()
        out[f"{m}x{k}x{n}"] = 2 * m * k * n * reps / (time.perf_counter() - t0) / 1e12
    return out


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    return f"cpu: {model or platform.machine()}, {torch.get_num_threads()} threads"


def print_table(rows: list[dict[str, Any]]) -> None:
    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    print(
        "| shape | variant | params | tokens/step | step s | tokens/s | MFU | peak GiB "
        "| plain s | plain tokens/s | plain MFU | plain peak GiB | plain/step |"
    )
    print("|---" * 13 + "|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['variant']} | {r['params'] / 1e6:.1f}M | {r['tokens_per_step']} "
            f"| {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {f(r['mfu'], '.1%')} "
            f"| {f(r['peak_mem_gib'], '.2f')} | {f(r['plain_s'], '.3f')} "
            f"| {f(r['plain_tokens_per_s'], '.0f')} | {f(r['plain_mfu'], '.1%')} "
            f"| {f(r['plain_peak_mem_gib'], '.2f')} | {f(r['plain_over_step'], '.2f')}x |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if cuda else "cpu")
    ap.add_argument("--shape", action="append", help=f"repeatable or comma list of {list(SHAPES)}")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--variants", nargs="+", default=[], metavar="LABEL:OVERRIDES")
    ap.add_argument(
        "--backend", choices=["torch", "megatron"], help="short for --set train.backend"
    )
    ap.add_argument("--repeats", type=int, default=3, help="measured rounds after one warm-up")
    ap.add_argument("--peak-tflops", type=float, help="MFU's peak (default on CUDA: 989, H100)")
    ap.add_argument("--force", action="store_true", help="run GPU shapes on CPU anyway")
    ap.add_argument("--out", help="JSON path (default bench/results/train_<device>.json)")
    ap.add_argument("--profile", action="store_true", help="print one step's torch.profiler table")
    ap.add_argument(
        "--nondeterministic",
        action="store_true",
        help="trainer steps without torch's deterministic algorithms (to see their cost)",
    )
    ap.add_argument("--trace", help="with --profile: a folder for each row's Chrome trace")
    args = ap.parse_args()
    transformers.utils.logging.disable_progress_bar()  # a bar per load buries the table
    if args.device == "cuda" and not cuda:
        raise SystemExit("--device cuda: torch sees no CUDA device; run on a GPU or --device cpu")
    if args.peak_tflops is None and args.device == "cuda":
        args.peak_tflops = 989.0
    default_shapes = "tiny" if args.device == "cpu" else "smollm2-gpu,qwen2-0.5b"
    shapes = [s for arg in args.shape or [default_shapes] for s in arg.split(",") if s]
    for name in shapes:
        if name not in SHAPES:
            raise SystemExit(f"--shape {name!r}: choose from {list(SHAPES)}")
        if SHAPES[name].gpu_only and args.device == "cpu" and not args.force:
            raise SystemExit(
                f"--shape {name} is a GPU shape (minutes per step on CPU); run it with "
                "--device cuda, or pass --force to run it on CPU anyway"
            )
    common = ([f"train.backend={args.backend}"] if args.backend else []) + args.set
    variants = [parse_variant(v) for v in args.variants] or [("default", [])]
    # The card's own GEMM rate: a square one, and one of the 0.5B shape's MLP GEMMs
    # at a micro-batch of 16 x 256 tokens.
    gemm = matmul_tflops(((8192, 8192, 8192), (4096, 896, 4864))) if args.device == "cuda" else {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in shapes:
            shape = SHAPES[name]
            sections = {
                label: trainer_sections(shape, common + sets, label, root / "runs", args.device)
                for label, sets in variants
            }  # every variant checked before the first model is written
            path = shape.write(root / name)
            vocab = AutoConfig.from_pretrained(path).vocab_size
            store = RunStore(StorageConfig(root=str(root / "runs")), name)
            dims = (shape.prompts, shape.n, shape.prompt_len, shape.response_len)
            for k in range(1, args.repeats + 3):  # warm-up, repeats, one for --profile
                store.write_rollouts(k, rollouts(k, vocab, *dims).to_json())
            for label, sec in sections.items():
                rows.append(bench_row(name, path, label, sec, args))
    device = device_name(args.device)
    peak = f"{args.peak_tflops:g} TFLOP/s (--peak-tflops)" if args.peak_tflops else "none given"
    plain = "fp32 master + bf16 autocast, TF32" if args.device == "cuda" else "fp32, no autocast"
    print(f"\ntrain step vs plain PyTorch ({plain}) on {device}, torch {torch.__version__}")
    print(f"median of {args.repeats} after 1 warm-up; MFU = 6*N*tokens/s over peak {peak}")
    if gemm:
        print(
            "this card's bf16 GEMM: " + ", ".join(f"{k} {v:.0f} TFLOP/s" for k, v in gemm.items())
        )
    for label, sets in variants:
        print(f"  variant {label}: {' '.join(common + sets) or 'bench defaults'}")
    print()
    print_table(rows)
    out = Path(args.out or Path(__file__).parent / "results" / f"train_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "command": shlex.join(["python", "-m", "bench.train", *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peak_tflops": args.peak_tflops,
        "gemm_tflops": gemm,
        "mfu_flops_per_token": "6 * params (forward + backward)",
        "plain_loop": plain,
        "repeats": args.repeats,
        "variants": {label: common + sets for label, sets in variants},
        "rows": rows,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
