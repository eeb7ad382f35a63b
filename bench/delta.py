"""Benchmark: publishing and pulling delta versions (storage.delta) vs full versions.

Two states, each published as v0 (full), then v1..vN after N optimizer steps:

- ``tiny``: the tiny Llama (training/tiny_model.py), fp32 master weights, real
  AdamW steps (lr = tiny-cpu's 3e-3) of a next-token loss on random tokens,
  published in fp32 (what tiny-cpu publishes) and in bf16. Not RL steps: the
  same optimizer on another loss.
- ``0.5b``: Qwen2.5-0.5B's parameter shapes (494M, bf16, 988 MB), random
  weights (std 0.02, norms 1.0) held as fp32 master weights; each step moves
  every weight by lr x N(0, 1) (an Adam update has magnitude ~1 per element),
  lr 1e-6, and publishes the bf16 rounding. Synthetic: no gradient, no model.

For each version, on local disk and on a moto S3 server:

- full: ``WeightsWriter`` publish (sha256, fsync, manifest) of every byte, then
  a pull into a fresh cache (local: hard link + sha256 of every byte; S3: GET).
- delta: ``weights_writer(full_every=N+1)`` publish (XOR against v0, zstd, the
  full sha256 of the new bytes), then a pull + rebuild into a cache that holds
  v0 already (steady state: an engine holds the base it reloads from).

The first delta also pays what is paid once per base (the publisher hashes the
base's files; on S3 it pulls the base into its cache): its row shows it.
Figures: bytes stored, wall seconds and this process's CPU seconds (the machine
is shared: CPU seconds move less with other tenants' load). No assertions.

    python -m bench.delta --steps 3 --s3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from storage import RunStore, S3Options, StorageConfig  # noqa: E402
from storage.safetensors_io import TensorEntry, write_hf_shards  # noqa: E402

MB = 1 << 20
SHARD = 512 * MB  # weights.shard_size's default
RESULTS = Path(__file__).resolve().parent / "results" / "delta_cpu.json"


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even fp32 -> bf16, as uint16 bits (what torch's .to(bfloat16) does)."""
    u = a.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def qwen_05b_shapes() -> dict[str, tuple[int, ...]]:
    h, inter, kv, vocab, layers = 896, 4864, 128, 151936, 24
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    out["model.norm.weight"] = (h,)
    return out


def synthetic_states(steps: int, lr: float) -> tuple[list[list[TensorEntry]], list[float]]:
    """bf16 entries of v0..v{steps} of the 0.5B shape and the fraction of bf16 values
    each step changed (vs the version before)."""
    rng = np.random.default_rng(0)
    master = {}
    for name, shape in qwen_05b_shapes().items():
        n = int(np.prod(shape))
        if "norm" in name:
            master[name] = np.ones(n, np.float32)
        else:
            master[name] = (rng.standard_normal(n, dtype=np.float32) * 0.02).astype(np.float32)
    shapes = qwen_05b_shapes()
    versions, fractions = [], []
    prev = None
    for step in range(steps + 1):
        if step:
            for w in master.values():
                w -= lr * rng.standard_normal(w.size, dtype=np.float32)
        bits = {k: bf16_bits(w) for k, w in master.items()}
        if prev is not None:
            changed = sum(int(np.count_nonzero(bits[k] != prev[k])) for k in bits)
            fractions.append(changed / sum(b.size for b in bits.values()))
        prev = bits
        versions.append([_entry(k, "BF16", shapes[k], b) for k, b in bits.items()])
    return versions, fractions


def tiny_states(steps: int, dtype: str) -> tuple[list[list[TensorEntry]], list[float]]:
    import torch
    from transformers import LlamaForCausalLM

    from training.export import tensor_entry
    from training.tiny_model import build_tokenizer, tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(len(build_tokenizer())))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    td = torch.float32 if dtype == "F32" else torch.bfloat16
    versions, fractions, prev = [], [], None
    for step in range(steps + 1):
        if step:
            ids = torch.randint(0, model.config.vocab_size, (16, 24))
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        state = {k: v.detach().to(td).clone() for k, v in model.state_dict().items()}
        if prev is not None:
            changed = sum(int((state[k] != prev[k]).sum()) for k in state)
            fractions.append(changed / sum(t.numel() for t in state.values()))
        prev = state
        versions.append([tensor_entry(k, t) for k, t in state.items()])
    return versions, fractions


def _entry(name: str, dtype: str, shape: tuple[int, ...], a: np.ndarray) -> TensorEntry:
    return TensorEntry(name=name, dtype=dtype, shape=shape, data=memoryview(a).cast("B"))


def timed(fn: Callable[..., object], *args: object, **kw: object) -> tuple[float, float, Any]:
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = fn(*args, **kw)
    t, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return t, cpu, out


def publish(
    store: RunStore,
    v: int,
    entries: list[TensorEntry],
    every: int | None,
    base_cache: str | None = None,
):
    w = store.weights_writer(
        v, v, v - 1 if v else None, full_every=every, base_cache_dir=base_cache
    )
    write_hf_shards(w.open, entries, shard_size=SHARD)
    return w.commit()


def run_state(
    name: str,
    versions: list,
    fractions: list,
    cfg_of: Callable[[str], StorageConfig],
    where: str,
    tmp: str,
) -> list[dict]:
    """Rows of one state on one root: full vs delta for v1..vN."""
    steps = len(versions) - 1
    full = RunStore(cfg_of("full"), f"{name}-full-{uuid.uuid4().hex[:6]}")
    delta = RunStore(cfg_of("delta"), f"{name}-delta-{uuid.uuid4().hex[:6]}")
    base_cache = os.path.join(tmp, f"pub-{uuid.uuid4().hex[:6]}")
    publish(full, 0, versions[0], None)
    publish(delta, 0, versions[0], None)
    engine_cache = os.path.join(tmp, f"eng-{uuid.uuid4().hex[:6]}")
    delta.pull(0, engine_cache)  # the engines hold v0 already
    rows = []
    for v in range(1, steps + 1):
        tf, cf, mf = timed(publish, full, v, versions[v], None)
        cache = os.path.join(tmp, f"full-{v}-{uuid.uuid4().hex[:6]}")
        tpf, cpf, _ = timed(full.pull, v, cache)
        shutil.rmtree(cache)
        td, cd, md = timed(publish, delta, v, versions[v], steps + 1, base_cache)
        assert md.delta is not None and md.rebuilt().file_set() == mf.file_set()
        tpd, cpd, _ = timed(delta.pull, v, engine_cache)
        shutil.rmtree(os.path.join(engine_cache, f"v{v:06d}"))
        row = {
            "state": name,
            "root": where,
            "version": v,
            "changed_fraction_vs_prev": round(fractions[v - 1], 6),
            "full_bytes": mf.total_bytes(),
            "delta_bytes": md.total_bytes(),
            "bytes_ratio": round(md.total_bytes() / mf.total_bytes(), 4),
            "full_publish_s": round(tf, 3),
            "full_pull_s": round(tpf, 3),
            "delta_publish_s": round(td, 3),
            "delta_pull_rebuild_s": round(tpd, 3),
            "time_ratio": round((td + tpd) / (tf + tpf), 3),
            "full_cpu_s": round(cf + cpf, 3),
            "delta_cpu_s": round(cd + cpd, 3),
        }
        rows.append(row)
        print(
            f"| {name} | {where} | v{v} | {row['changed_fraction_vs_prev']:.4f} | "
            f"{mf.total_bytes() / MB:.2f} MB | {md.total_bytes() / MB:.3f} MB ({row['bytes_ratio']:.3f}) | "
            f"{tf:.2f} + {tpf:.2f} s | {td:.2f} + {tpd:.2f} s ({row['time_ratio']:.2f}x) | "
            f"{row['full_cpu_s']:.2f} / {row['delta_cpu_s']:.2f} |",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-6, help="0.5b state: step size")
    ap.add_argument("--out", default=str(RESULTS), help="results JSON")
    ap.add_argument("--states", nargs="+", default=["tiny-f32", "tiny-bf16", "0.5b"])
    ap.add_argument("--s3", action="store_true", help="also on a moto S3 server")
    args = ap.parse_args()
    states = {}
    for s in args.states:
        if s == "0.5b":
            states[s] = synthetic_states(args.steps, args.lr)
        else:
            states[s] = tiny_states(args.steps, "F32" if s == "tiny-f32" else "BF16")
    print(
        "| state | root | version | changed bf16/fp32 values | full | delta (ratio) | full publish + pull | delta publish + pull/rebuild (ratio) | CPU s full / delta |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-delta-") as tmp:
        for s, (versions, fr) in states.items():
            rows += run_state(
                s,
                versions,
                fr,
                lambda kind: StorageConfig(root=os.path.join(tmp, kind)),
                "disk",
                tmp,
            )
        if args.s3:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from s3_server import make_bucket, moto_s3

            with moto_s3() as url:
                make_bucket(url, "bench")
                for s, (versions, fr) in states.items():
                    rows += run_state(
                        s,
                        versions,
                        fr,
                        lambda kind: StorageConfig(
                            root=f"s3://bench/{kind}", s3=S3Options(endpoint_url=url)
                        ),
                        "moto s3",
                        tmp,
                    )
    meta = {
        "steps": args.steps,
        "lr_0.5b": args.lr,
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
