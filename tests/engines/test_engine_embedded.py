"""The embedded engine's generate and weight-reload contract, in process.

These call the plain class directly (no actor) because the semantics under
test do not depend on Ray; the actor behaviour is in test_engine_pause.py.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engines.config import EngineConfig
from engines.embedded.engine import EmbeddedEngine

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 12}


def _params(seed: int, **kw) -> dict:
    return dict(SAMPLING, sampling_seed=seed, **kw)


@pytest.fixture(scope="module")
def engine(tiny_dir) -> EmbeddedEngine:
    return EmbeddedEngine(str(tiny_dir), 0, EngineConfig(), weight_version=0)


PROMPTS = [
    [1, 5, 25, 6, 24],
    [1, 5, 6, 7, 8, 9, 10, 11, 12, 25, 13, 24],
    [1, 5],
    [1, 14, 15, 16, 22],
]


def test_generate_shapes_and_logprobs(engine):
    out = engine.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    assert len(out) == len(PROMPTS)
    for prompt, r in zip(PROMPTS, out):
        meta = r["meta_info"]
        assert meta["weight_version"] == "0"
        assert meta["prompt_tokens"] == len(prompt)
        assert meta["completion_tokens"] == len(r["output_ids"]) >= 1
        lps = meta["output_token_logprobs"]
        assert len(lps) == len(r["output_ids"])
        assert [t for _, t, _ in lps] == r["output_ids"]
        assert all(lp <= 0.0 for lp, _, _ in lps)
        assert meta["finish_reason"]["type"] in ("stop", "length")
        assert isinstance(r["text"], str)


def test_seed_determinism_and_batch_independence(engine):
    alone = [engine.generate([p], [_params(100 + i)])[0] for i, p in enumerate(PROMPTS)]
    together = engine.generate(PROMPTS, [_params(100 + i) for i in range(len(PROMPTS))])
    # Same request, other neighbours and padding: same tokens.
    shuffled = engine.generate(
        PROMPTS[::-1], [_params(100 + i) for i in range(len(PROMPTS))][::-1]
    )[::-1]
    for a, b, c in zip(alone, together, shuffled):
        assert a["output_ids"] == b["output_ids"] == c["output_ids"]
        for (la, _, _), (lb, _, _) in zip(
            a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        ):
            assert la == pytest.approx(lb, abs=1e-4)
    other_seed = engine.generate(
        [PROMPTS[1]] * 4, [_params(s, max_new_tokens=24) for s in range(4)]
    )
    assert len({tuple(r["output_ids"]) for r in other_seed}) > 1


def test_a_call_decodes_the_same_bits_beside_concurrent_calls(engine):
    """A call's rows never share a forward with another call's: its logprobs, to
    the last bit, do not depend on what else the engine was asked meanwhile."""
    params = [_params(100 + i) for i in range(len(PROMPTS))]
    alone = engine.generate(PROMPTS, params)
    engine.pause_generation("abort")  # queue the neighbours first, then release all
    with ThreadPoolExecutor(4) as pool:
        noise = [pool.submit(engine.generate, [p], [_params(7)]) for p in PROMPTS[:3]]
        beside = pool.submit(engine.generate, PROMPTS, params)
        time.sleep(0.2)
        engine.continue_generation()
        assert all(len(f.result(timeout=60)) == 1 for f in noise)
        assert beside.result(timeout=60) == alone


def test_length_vs_stop(engine):
    long = engine.generate([PROMPTS[0]], [_params(1, max_new_tokens=40, stop_token_ids=[])])[0]
    assert long["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    assert len(long["output_ids"]) == 40
    # Stop on the first token the unconstrained run produced: it must end there.
    first = long["output_ids"][0]
    stopped = engine.generate(
        [PROMPTS[0]], [_params(1, max_new_tokens=40, stop_token_ids=[first])]
    )[0]
    assert stopped["output_ids"] == [first]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    # Default stop is the tokenizer's eos: greedy on a prompt that ends in eos quickly.
    ends = engine.generate([[1, 5]] * 8, [_params(s, max_new_tokens=40) for s in range(8)])
    for r in ends:
        reason = r["meta_info"]["finish_reason"]
        if reason["type"] == "stop":
            assert reason["matched"] == 2 and r["output_ids"][-1] == 2
        else:
            assert 2 not in r["output_ids"] and len(r["output_ids"]) == 40


def test_greedy_matches_hf_generate(engine):
    import torch

    out = engine.generate(
        [PROMPTS[1]], [{"temperature": 0.0, "max_new_tokens": 10, "stop_token_ids": []}]
    )[0]
    ref = engine.served.model.generate(
        torch.tensor([PROMPTS[1]]),
        max_new_tokens=10,
        do_sample=False,
        eos_token_id=None,
        min_new_tokens=10,
    )
    assert out["output_ids"] == ref[0, len(PROMPTS[1]) :].tolist()


def test_bad_sampling_params_are_refused(engine):
    with pytest.raises(ValueError, match="unsupported"):
        engine.generate([[1, 5]], [{"temprature": 1.0}])
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[1, 5]], [{"top_p": 0.0}])


def test_update_weights_from_disk(tiny_dir, tiny_v1, broken_dir):
    eng = EmbeddedEngine(str(tiny_dir), 0, EngineConfig(), weight_version=0)
    req = [_params(7, max_new_tokens=16, stop_token_ids=[])]
    before = eng.generate([PROMPTS[1]], req)[0]

    bad = eng.update_weights_from_disk(str(broken_dir), weight_version="1")
    assert bad["success"] is False and "missing" in bad["message"]
    assert eng.get_weight_version() == "0"
    assert eng.generate([PROMPTS[1]], req)[0]["output_ids"] == before["output_ids"]
    missing = eng.update_weights_from_disk(str(tiny_dir / "nope"), weight_version="1")
    assert missing["success"] is False and eng.get_weight_version() == "0"

    ok = eng.update_weights_from_disk(str(tiny_v1), weight_version="1")
    assert ok["success"] is True, ok["message"]
    assert eng.get_weight_version() == "1"
    info = eng.model_info()
    assert info["weight_version"] == "1" and info["model_path"] == str(tiny_v1)
    after = eng.generate([PROMPTS[1]], req)[0]
    assert after["meta_info"]["weight_version"] == "1"
    assert (
        after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
    )

    # Back to v0 (version numbers are labels; the caller keeps them monotonic).
    assert eng.update_weights_from_disk(str(tiny_dir), weight_version="2")["success"]
    assert eng.generate([PROMPTS[1]], req)[0]["output_ids"] == before["output_ids"]


def test_health_flush_memory(engine):
    assert engine.health_generate() is True
    assert engine.flush_cache() is True
    assert engine.release_memory_occupation()["success"]
    assert engine.resume_memory_occupation()["success"]
    assert (
        engine.generate([[1, 5]], [_params(0, max_new_tokens=2)])[0]["meta_info"][
            "completion_tokens"
        ]
        >= 1
    )
