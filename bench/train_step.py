"""Train-step throughput of the torch backend, against raw HF forward+backward.

For each model (the tiny Llama, and a larger random-init Qwen2) it times
``TrainActor.train_step`` (the real path: rollouts read from a local run
store, old-logprob recompute, GRPO loss, clip, AdamW) and, as the baseline
measured in the same run, one plain forward+backward+AdamW step of the same
HF model over the same tokens. Prints a markdown table and writes
``bench/results/train_step.json``. One rank, no Ray: this measures the step,
not the orchestration.

    python bench/train_step.py [--device cpu|cuda] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

# bench/rollout.py would shadow the rollout package when run as a script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from rollout.types import RolloutBatch, Sample  # noqa: E402
from storage.config import StorageConfig  # noqa: E402
from storage.run_store import RunStore  # noqa: E402
from training.actor import TrainActor  # noqa: E402
from training.config import ModelConfig, TrainConfig  # noqa: E402
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


def rollouts(k: int, vocab: int) -> RolloutBatch:
    rng = random.Random(k)
    samples = [
        Sample(
            p,
            j,
            [1] + [rng.randrange(4, vocab) for _ in range(PROMPT_LEN - 1)],
            [rng.randrange(4, vocab) for _ in range(RESPONSE_LEN)],
            [-1.0] * RESPONSE_LEN,
            float(rng.random() < 0.5),
            k - 1,
            "length",
        )
        for p in range(PROMPTS)
        for j in range(N)
    ]
    return RolloutBatch(k, N, samples)


def bench_model(name: str, path: Path, root: Path, device: str, repeats: int) -> dict:
    vocab = AutoModelForCausalLM.from_pretrained(path).config.vocab_size
    store_cfg = StorageConfig(root=str(root))
    store = RunStore(store_cfg, name)
    for k in range(1, repeats + 2):
        store.write_rollouts(k, rollouts(k, vocab).to_json())
    cfg = TrainConfig(
        micro_batch_size=8,
        torch_threads=torch.get_num_threads(),
        num_gpus_per_worker=1.0 if device == "cuda" else 0.0,
    )
    actor = TrainActor(0, 1, "127.0.0.1", 0, cfg, ModelConfig(), store_cfg, name, seed=0)
    actor.setup()
    actor.init_from_base(str(path))

    # Baseline: the same tokens through plain HF forward + backward + AdamW.
    model = AutoModelForCausalLM.from_pretrained(path).to(device)
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
    tokens = steps[-1]["tokens"]
    step_s = statistics.median(m["train_s"] for m in steps[1:])
    raw_s = statistics.median(raw[1:])
    params = sum(p.numel() for p in model.parameters())
    return {
        "model": name,
        "params": params,
        "tokens_per_step": tokens,
        "train_step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "raw_fwd_bwd_s": raw_s,
        "raw_tokens_per_s": tokens / raw_s,
        "ratio_vs_raw": raw_s / step_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "train_step.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        models = {"tiny-llama": write_tiny_model(t / "tiny"), "qwen2-19m": write_qwen2(t / "qwen2")}
        for name, path in models.items():
            rows.append(bench_model(name, path, t / "runs", args.device, args.repeats))
    print(
        f"\ntrain step, device={args.device}, {PROMPTS * N} samples x "
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
            {"device": args.device, "threads": torch.get_num_threads(), "rows": rows}, indent=2
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
