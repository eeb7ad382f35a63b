"""Train-step throughput of the torch backend, against raw HF forward+backward.

For each model (the tiny Llama, and a larger random-init Qwen2) it times
``TrainActor.train_step`` (the real path: rollouts read from a local run
store, old-logprob recompute, GRPO loss, clip, AdamW) and, as the baseline
measured in the same run, one plain forward+backward+AdamW step of the same
HF model over the same tokens. Prints a markdown table and writes
``bench/results/train_step.json``. One rank, no Ray: this measures the step,
not the orchestration.

    python bench/train_step.py [--device cpu|cuda] [--repeats 3]
        [--backend torch|megatron] [--dtype float32|bfloat16] [--models a,b]

``--backend megatron`` times ``MegatronTrainActor.train_step`` (CUDA only);
``--models qwen2-0.5b`` adds a Qwen2.5-0.5B-shaped random-init model.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# bench/rollout.py would shadow the rollout package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from rollout.types import RolloutBatch, Sample  # noqa: E402
from storage.config import StorageConfig  # noqa: E402
from storage.run_store import RunStore  # noqa: E402
from training.config import (  # noqa: E402
    ModelConfig,
    RunIdentity,
    TrainConfig,
    TrainerSections,
    WeightsConfig,
)
from training.group import actor_class  # noqa: E402
from training.tiny_model import write_tiny_model  # noqa: E402

PROMPTS, N, PROMPT_LEN, RESPONSE_LEN = 8, 4, 16, 48


def write_qwen2(out: Path) -> Path:
    """A ~19M-parameter random-init Qwen2 (no tokenizer: train_step needs none)."""
    cfg = Qwen2Config(
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
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return out


def write_qwen2_05b(out: Path) -> Path:
    """Qwen2.5-0.5B's shape (~494M parameters, tied embeddings), random init, bf16 on disk."""
    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


MODELS = {"tiny-llama": write_tiny_model, "qwen2-19m": write_qwen2, "qwen2-0.5b": write_qwen2_05b}


def rollouts(
    k: int,
    vocab: int,
    prompts: int = PROMPTS,
    n: int = N,
    prompt_len: int = PROMPT_LEN,
    response_len: int = RESPONSE_LEN,
    alternate: bool = False,
) -> RolloutBatch:
    """A GRPO batch of random tokens for iteration ``k`` (its own seed). Rewards are
    random, or with ``alternate`` 0, 1, 0, ... within each prompt's group, so that every
    group has a non-zero advantage (as a learning run's batches do)."""
    rng = random.Random(k)
    samples = [
        Sample(
            p,
            j,
            [1] + [rng.randrange(4, vocab) for _ in range(prompt_len - 1)],
            [rng.randrange(4, vocab) for _ in range(response_len)],
            [-1.0] * response_len,
            float(j % 2) if alternate else float(rng.random() < 0.5),
            k - 1,
            "length",
        )
        for p in range(prompts)
        for j in range(n)
    ]
    return RolloutBatch(k, n, samples)


def bench_model(
    name: str,
    path: Path,
    root: Path,
    device: str,
    repeats: int,
    backend: str = "torch",
    dtype: str = "float32",
    profile: bool = False,
) -> dict:
    vocab = AutoModelForCausalLM.from_pretrained(path).config.vocab_size
    store_cfg = StorageConfig(root=str(root))
    store = RunStore(store_cfg, name)
    for k in range(1, repeats + 2 + int(profile)):
        store.write_rollouts(k, rollouts(k, vocab).to_json())
    cfg = TrainConfig(
        backend=backend,
        micro_batch_size=8,
        torch_threads=torch.get_num_threads(),
        num_gpus_per_worker=1.0 if device == "cuda" else 0.0,
    )
    sections = TrainerSections(
        train=cfg, model=ModelConfig(dtype=dtype), storage=store_cfg, weights=WeightsConfig()
    )
    identity = RunIdentity(name=name, seed=0, namespace="prefect-rl")
    actor = actor_class(backend)(identity, sections, 0, "127.0.0.1", 0)
    actor.setup()
    actor.init_from_base(str(path))

    # Baseline: the same tokens through plain HF forward + backward + AdamW.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor([s.prompt_ids + s.response_ids for s in rollouts(1, vocab).samples])
    chunks = ids.to(device).split(cfg.micro_batch_size)

    def raw_step() -> float:
        t0 = time.perf_counter()
        for chunk in chunks:
            model(input_ids=chunk, labels=chunk).loss.backward()
        opt.step()
        opt.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    # Alternate the two, so load from other processes hits both alike; the
    # first round warms up.
    steps, raw = [], []
    for k in range(1, repeats + 2):
        steps.append(actor.train_step(k))
        raw.append(raw_step())
    if profile:  # one more step under torch.profiler: where the step's time goes
        print_profile(name, backend, lambda: actor.train_step(repeats + 2))
    tokens = steps[-1]["tokens"]
    step_s = statistics.median(m["train_s"] for m in steps[1:])
    raw_s = statistics.median(raw[1:])
    params = sum(p.numel() for p in model.parameters())
    actor = model = opt = None  # free GPU memory before the next model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "model": name,
        "backend": backend,
        "dtype": dtype,
        "params": params,
        "tokens_per_step": tokens,
        "train_step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "raw_fwd_bwd_s": raw_s,
        "raw_tokens_per_s": tokens / raw_s,
        "ratio_vs_raw": raw_s / step_s,
    }


def print_profile(name: str, backend: str, step: Callable[[], object]) -> None:
    """The top operators of one ``step()`` by device time (self time on CPU runs)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(f"\nprofile of one train step: {name}, backend={backend}")
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", choices=["torch", "megatron"], default="torch")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument(
        "--models", default="tiny-llama,qwen2-19m", help=f"comma list of {list(MODELS)}"
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "train_step.json"))
    ap.add_argument("--profile", action="store_true", help="print one step's torch.profiler table")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        for name in args.models.split(","):
            path = MODELS[name](t / name)
            rows.append(
                bench_model(
                    name,
                    path,
                    t / "runs",
                    args.device,
                    args.repeats,
                    args.backend,
                    args.dtype,
                    args.profile,
                )
            )
    print(
        f"\ntrain step, backend={args.backend}, dtype={args.dtype}, device={args.device}, "
        f"{PROMPTS * N} samples x "
        f"{PROMPT_LEN + RESPONSE_LEN} tokens, median of {args.repeats}\n"
    )
    print(
        "| model | params | tokens/step | step s | tokens/s | raw fwd+bwd tokens/s | step / raw |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['tokens_per_step']} | "
            f"{r['train_step_s']:.3f} | {r['tokens_per_s']:.0f} | {r['raw_tokens_per_s']:.0f} | "
            f"{r['ratio_vs_raw']:.2f}x |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "device": args.device,
                "backend": args.backend,
                "dtype": args.dtype,
                "threads": torch.get_num_threads(),
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
