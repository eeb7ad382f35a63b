"""Benchmark: embedded engine generation vs plain HF ``model.generate``.

Same model, same prompts, same batch size, same number of new tokens, same
sampling (temperature 1, top_p 1, no top-k) on CPU. Both generate exactly
``max_new_tokens`` per row: the engine with ``stop_token_ids=[]``, HF with
``min_new_tokens=max_new_tokens`` (eos masked), so the work is equal. The
engine is called in process (no Ray), so this measures its decode loop, not
actor overhead. Models: the tiny default model and a larger random-init
Llama (hidden 512, 8 layers) where compute, not Python, dominates.

    python bench/rollout.py --batch 16 --max-new-tokens 64 --repeats 3

Runs of the two alternate, so load from other processes hits both alike.
Prints one markdown table of medians; writes bench/results/rollout.json.
No assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from engines.config import EngineConfig  # noqa: E402
from engines.embedded import EmbeddedEngine  # noqa: E402
from training.tiny_model import build_tokenizer, write_tiny_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "rollout.json"


def write_medium_model(out: Path) -> Path:
    """A random-init Llama big enough that matmuls dominate a decode step."""
    tok = build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def make_prompts(batch: int, seed: int = 0) -> list[list[int]]:
    """bos + 8..24 random character tokens (the non-special ids), varied lengths."""
    g = torch.Generator().manual_seed(seed)
    vocab = len(build_tokenizer())
    lens = torch.randint(8, 25, (batch,), generator=g).tolist()
    return [[1] + torch.randint(4, vocab, (n,), generator=g).tolist() for n in lens]


def paired(a: Callable[[], int], b: Callable[[], int], repeats: int) -> list[tuple[float, int]]:
    """Median seconds and tokens per run of ``a`` and ``b``, each warmed up once.

    Runs alternate a, b, a, b ... so that load from other processes on a
    shared machine hits both sides alike.
    """
    fns = (a, b)
    tokens = [fn() for fn in fns]
    times: list[list[float]] = [[], []]
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            assert fn() == tokens[k]
            times[k].append(time.perf_counter() - t0)
    return [(statistics.median(t), n) for t, n in zip(times, tokens)]


def bench_model(name: str, path: Path, batch: int, new: int, repeats: int) -> dict:
    engine = EmbeddedEngine(str(path), 0, EngineConfig(max_batch_size=batch))
    model = engine._model  # the very same weights for the baseline
    prompts = make_prompts(batch)
    params = [
        {
            "temperature": 1.0,
            "top_p": 1.0,
            "max_new_tokens": new,
            "sampling_seed": i,
            "stop_token_ids": [],
        }
        for i in range(batch)
    ]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (
        torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]
    ).long()

    def run_engine() -> int:
        return sum(r["meta_info"]["completion_tokens"] for r in engine.generate(prompts, params))

    @torch.inference_mode()
    def run_hf() -> int:
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
        )
        return int((out.shape[1] - width) * batch)

    (t_eng, n_eng), (t_hf, n_hf) = paired(run_engine, run_hf, repeats)
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    return {
        "model": name,
        "params_m": round(params_m, 2),
        "batch": batch,
        "max_new_tokens": new,
        "engine_s": t_eng,
        "hf_s": t_hf,
        "engine_tok_s": n_eng / t_eng,
        "hf_tok_s": n_hf / t_hf,
        "ratio": (n_eng / t_eng) / (n_hf / t_hf),
    }


def table(rows: list[dict]) -> str:
    head = "| model | params (M) | batch | new tokens | engine tok/s | HF generate tok/s | engine / HF |\n"
    head += "|---|---|---|---|---|---|---|\n"
    return head + "".join(
        f"| {r['model']} | {r['params_m']} | {r['batch']} | {r['max_new_tokens']} | "
        f"{r['engine_tok_s']:.0f} | {r['hf_tok_s']:.0f} | {r['ratio']:.2f}x |\n"
        for r in rows
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "tiny (h64, 2 layers)": write_tiny_model(Path(tmp) / "tiny"),
            "medium (h512, 8 layers)": write_medium_model(Path(tmp) / "medium"),
        }
        for name, path in models.items():
            rows.append(bench_model(name, path, args.batch, args.max_new_tokens, args.repeats))
            torch.set_num_threads(args.threads)  # the engine sets its own count
    md = table(rows)
    print(md)
    meta = {
        "device": "cpu",
        "threads": args.threads,
        "repeats": args.repeats,
        "stat": "median",
        "torch": torch.__version__,
        "loadavg_1m_at_end": os.getloadavg()[0],
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"meta": meta, "rows": rows, "table": md}, indent=1) + "\n")


if __name__ == "__main__":
    main()
