"""The real-SGLang side of ``bench.rollout``: one server on the bench's model, timed
over HTTP on the same prompts, batch, new tokens and sampling as the other sides.

SGLang runs in its own environment (``--sglang SITE``: an unpacked site folder
first on the server's PYTHONPATH) with CUDA graphs captured up to the largest
batch, as a run would use it. The server is called the way rollout calls it:
one ``/generate`` with the whole batch, a sampling dict per row
(``ignore_eos``: every row makes exactly ``max_new_tokens``).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from engines.config import EngineConfig, SGLangConfig
from engines.sglang.engine import SGLangEngine

# The trimmed kernel package of the test machine serves with these backends.
ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch"]


def start(model: Path, site: str, max_batch: int, mem_fraction: float = 0.4) -> SGLangEngine:
    sc = SGLangConfig(
        pythonpath=[site],
        extra_args=ARGS,
        mem_fraction_static=mem_fraction,
        cuda_graph_max_bs=max_batch,
    )
    return SGLangEngine(str(model), 0, EngineConfig(kind="sglang", sglang=sc))


def generate_tokens(engine: SGLangEngine, prompts: list[list[int]], new: int) -> int:
    params = [
        {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": new, "ignore_eos": True}
        | {"sampling_seed": i}
        for i in range(len(prompts))
    ]
    out = engine.client.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    return sum(r["meta_info"]["completion_tokens"] for r in out)


def bench(engine: SGLangEngine, prompts: list[list[int]], new: int, repeats: int) -> dict:
    """Median seconds and tok/s of the whole batch over HTTP, after one short warm-up."""
    generate_tokens(engine, prompts, min(new, 8))
    times, tokens = [], set()
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens.add(generate_tokens(engine, prompts, new))
        times.append(time.perf_counter() - t0)
    assert len(tokens) == 1, f"token counts changed between runs: {tokens}"
    s = statistics.median(times)
    return {"sglang_s": s, "sglang_tok_s": tokens.pop() / s}
