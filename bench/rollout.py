"""Benchmark: embedded engine generation vs plain HF ``model.generate`` (and, with
``--sglang SITE`` on CUDA, a real SGLang server of the same model: ``bench.sglang_side``).

Same model, same prompts, same batch size, same number of new tokens, same
sampling (temperature 1, top_p 1, no top-k). Both generate exactly
``max_new_tokens`` per row: the engine with ``stop_token_ids=[]``, HF with
``min_new_tokens=max_new_tokens`` (eos masked), so the work is equal. The
engine is called in process (no Ray), so this measures its decode loop, not
actor overhead. The HF baseline runs on the engine's own model object: the
same weights, dtype and device.

Models (random init, built in code, nothing downloaded; all use the tiny
character tokenizer of ``training.tiny_model``):
- ``tiny``: the default tiny Llama (h64, 2 layers).
- ``medium``: a Llama with h512, 8 layers, where compute, not Python, dominates.
- ``qwen2-0.5b``: Qwen2.5-0.5B's shape (h896, 24 layers, 14/2 heads, vocab
  151936, tied embeddings), saved in bf16. The engine loads it as bf16 on
  CUDA and as float32 on CPU (as ``EmbeddedEngine`` always does on CPU).

    python -m bench.rollout                       # CPU: tiny + medium, batch 16
    python -m bench.rollout --device cuda --model qwen2-0.5b \
        --batch 32 128 --max-new-tokens 128 --repeats 2

Each side is warmed up once with a short run of the same batch, then runs
alternate (engine, HF, engine, HF ...) so load from other processes hits
both alike; on CUDA every timing is bracketed by ``torch.cuda.synchronize()``.
A third number times the engine's per-step sampling alone
(``engines.embedded.sampling.sample_rows`` on the logits' device) at each batch size,
to show how much of an engine step it is. Prints one markdown table of medians; writes
bench/results/rollout.json (CPU) or rollout_cuda.json (CUDA). No assertions
about speed.
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
from collections.abc import Callable, Iterator
from pathlib import Path

# Run as a script, bench/ would come first on sys.path and this file would
# shadow the ``rollout`` package; put the repo root there instead.
_BENCH = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _BENCH]
sys.path.insert(0, str(_BENCH.parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engines.config import EngineConfig  # noqa: E402
from engines.embedded.engine import EmbeddedEngine  # noqa: E402
from engines.embedded.sampling import make_generator, sample_rows  # noqa: E402
from engines.types import SamplingParams  # noqa: E402
from training.tiny_model import build_tokenizer, write_tiny_model  # noqa: E402

RESULTS = _BENCH / "results"


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


def write_qwen2_05b(out: Path) -> Path:
    """Qwen2.5-0.5B's shape (~494M parameters), random init, bf16 on disk.

    The real vocab size is kept (the LM head and the sampling over 151936
    logits are a large part of a decode step); the tokenizer is the tiny
    character one, whose ids are all below it.
    """
    tok = build_tokenizer()
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
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    assert cfg.vocab_size >= len(tok)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


# --model name -> (label in the table, writer of an HF dir with tokenizer)
MODELS: dict[str, tuple[str, Callable[[Path], Path]]] = {
    "tiny": ("tiny (h64, 2 layers)", write_tiny_model),
    "medium": ("medium (h512, 8 layers)", write_medium_model),
    "qwen2-0.5b": ("qwen2-0.5b shape (h896, 24 layers)", write_qwen2_05b),
}


def make_prompts(batch: int, seed: int = 0) -> list[list[int]]:
    """bos + 8..24 random character tokens (the non-special ids), varied lengths."""
    g = torch.Generator().manual_seed(seed)
    vocab = len(build_tokenizer())
    lens = torch.randint(8, 25, (batch,), generator=g).tolist()
    return [[1] + torch.randint(4, vocab, (n,), generator=g).tolist() for n in lens]


def paired(
    a: Callable[[], int], b: Callable[[], int], repeats: int, sync: Callable[[], None]
) -> list[tuple[float, int]]:
    """Median seconds and tokens per run of ``a`` and ``b``.

    Runs alternate a, b, a, b ... so that load from other processes on a
    shared machine hits both sides alike. ``sync`` waits for queued device
    work before and after each timed run.
    """
    fns = (a, b)
    times: list[list[float]] = [[], []]
    tokens: list[set[int]] = [set(), set()]
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            sync()
            t0 = time.perf_counter()
            tokens[k].add(fn())
            sync()
            times[k].append(time.perf_counter() - t0)
    assert all(len(n) == 1 for n in tokens), f"token counts changed between runs: {tokens}"
    return [(statistics.median(t), n.pop()) for t, n in zip(times, tokens)]


def host_sampling_ms(engine: EmbeddedEngine, batch: int, repeats: int = 3) -> float:
    """Median ms of the decode loop's per-step sampling alone at this batch size.

    What ``engines.embedded.decode`` does with each step's logits: ``sample_rows`` on
    their device, one CPU generator per row drawing one uniform each.
    Random logits in the model's dtype on its device stand in for real ones.
    """
    model, device = engine.served.model, engine.served.device
    vocab = model.config.vocab_size
    logits = torch.randn(batch, vocab, device=device, dtype=model.dtype)
    params = [SamplingParams.from_dict({"temperature": 1.0, "top_p": 1.0})] * batch
    gens = [make_generator(i) for i in range(batch)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sample_rows(logits, params, gens)  # returns host lists: includes the device sync
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def bench_batch(
    engine: EmbeddedEngine, batch: int, new: int, repeats: int, sglang: object = None
) -> dict:
    """Time engine.generate against model.generate on one batch of prompts (and a real
    SGLang server of the same model, ``bench.sglang_side``, where given)."""
    model, device = engine.served.model, engine.served.device  # the very same weights
    prompts = make_prompts(batch)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    pads = torch.tensor([width - len(p) for p in prompts], device=device)
    mask = (torch.arange(width, device=device)[None, :] >= pads[:, None]).long()

    def run_engine(n_new: int) -> int:
        params = [
            {
                "temperature": 1.0,
                "top_p": 1.0,
                "max_new_tokens": n_new,
                "sampling_seed": i,
                "stop_token_ids": [],
            }
            for i in range(batch)
        ]
        return sum(r["meta_info"]["completion_tokens"] for r in engine.generate(prompts, params))

    @torch.inference_mode()
    def run_hf(n_new: int) -> int:
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            pad_token_id=0,
        )
        return int((out.shape[1] - width) * batch)

    # Warm-up (kernels, allocator, lazy init) with a short run of each side:
    # the engine's sampling is slow enough on CUDA that full-length warm-ups
    # would double the bench's run time.
    run_engine(min(new, 8))
    run_hf(min(new, 8))
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    (t_eng, n_eng), (t_hf, n_hf) = paired(
        lambda: run_engine(new), lambda: run_hf(new), repeats, sync
    )
    side = {}
    if sglang is not None:
        from bench import sglang_side

        side = sglang_side.bench(sglang, prompts, new, repeats)
        side["sglang_vs_engine"] = side["sglang_tok_s"] / (n_eng / t_eng)
    return {
        **side,
        "batch": batch,
        "max_new_tokens": new,
        "engine_s": t_eng,
        "hf_s": t_hf,
        "engine_tok_s": n_eng / t_eng,
        "hf_tok_s": n_hf / t_hf,
        "ratio": (n_eng / t_eng) / (n_hf / t_hf),
        "engine_ms_per_step": 1e3 * t_eng / new,
        "hf_ms_per_step": 1e3 * t_hf / new,
        "engine_host_sampling_ms_per_step": host_sampling_ms(engine, batch),
    }


def bench_model(
    name: str,
    path: Path,
    batches: list[int],
    new: int,
    repeats: int,
    device: str,
    threads: int,
    sglang_site: str | None = None,
) -> Iterator[dict]:
    """One engine per model (sized for the largest batch); yields a row per batch size.

    The engine's decode thread keeps it alive after this returns: fine for a
    bench of a few models.
    """
    cfg = EngineConfig(
        max_batch_size=max(batches),
        torch_threads=threads,
        num_gpus_per_engine=1.0 if device == "cuda" else 0.0,
        # The tiny model declares 64 positions; RoPE runs past them and HF generate
        # does too, so the bench lifts the engine's request limit to compare equal work.
        context_length=4096,
    )
    engine = EmbeddedEngine(str(path), 0, cfg)
    picked = engine.served.device
    if picked.type != device:
        raise RuntimeError(f"engine picked {picked}, not {device}: is CUDA available?")
    model = engine.served.model
    info = {
        "model": name,
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        "dtype": str(model.dtype).removeprefix("torch."),
    }
    sglang = None
    if sglang_site:
        from bench import sglang_side

        sglang = sglang_side.start(path, sglang_site, max(batches))
        info["sglang_startup_s"] = round(sglang.startup_s, 1)
    try:
        for b in batches:
            yield {**info, **bench_batch(engine, b, new, repeats, sglang)}
    finally:
        if sglang is not None:
            sglang.stop()


def table(rows: list[dict]) -> str:
    head = "| model | params (M) | dtype | batch | new tokens | engine tok/s "
    head += "| HF generate tok/s | engine / HF | engine ms/step (of which sampling) "
    head += "| HF ms/step |\n" + "|---" * 10 + "|\n"
    return (
        head
        + "".join(
            f"| {r['model']} | {r['params_m']} | {r['dtype']} | {r['batch']} | "
            f"{r['max_new_tokens']} | {r['engine_tok_s']:.0f} | {r['hf_tok_s']:.0f} | "
            f"{r['ratio']:.2f}x | {r['engine_ms_per_step']:.1f} "
            f"({r['engine_host_sampling_ms_per_step']:.1f}) | {r['hf_ms_per_step']:.1f} |\n"
            for r in rows
        )
        + "".join(
            f"\nSGLang, {r['model']}, batch {r['batch']}: {r['sglang_tok_s']:.0f} tok/s, "
            f"{r['sglang_vs_engine']:.1f}x the embedded engine (server ready in "
            f"{r['sglang_startup_s']} s)"
            for r in rows
            if "sglang_tok_s" in r
        )
    )


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def environment(device: str, threads: int, repeats: int) -> dict:
    """What the numbers depend on, written next to them."""
    return {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else _cpu_name(),
        "threads": threads,
        "repeats": repeats,
        "stat": "median",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "loadavg_1m_at_end": os.getloadavg()[0],
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--model", nargs="+", choices=list(MODELS), default=["tiny", "medium"])
    ap.add_argument("--batch", type=int, nargs="+", default=[16], help="one or more batch sizes")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both")
    ap.add_argument(
        "--sglang", metavar="SITE", help="also time a real SGLang server (its site folder)"
    )
    ap.add_argument("--out", type=Path, help="default: bench/results/rollout[_cuda].json")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device; run on a GPU machine")
    out = args.out or RESULTS / ("rollout_cuda.json" if args.device == "cuda" else "rollout.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.model:
            name, write = MODELS[key]
            path = write(Path(tmp) / key)
            for row in bench_model(
                name,
                path,
                args.batch,
                args.max_new_tokens,
                args.repeats,
                args.device,
                args.threads,
                args.sglang,
            ):
                rows.append(row)
                # Rewritten after every row, so a run cut short keeps what it measured.
                meta = environment(args.device, args.threads, args.repeats)
                doc = {"meta": meta, "rows": rows, "table": table(rows)}
                out.write_text(json.dumps(doc, indent=1) + "\n")
                print(f"{name}, batch {row['batch']}: engine / HF {row['ratio']:.2f}x", flush=True)
            torch.set_num_threads(args.threads)  # the engine sets its own count
    print(table(rows))


if __name__ == "__main__":
    main()
