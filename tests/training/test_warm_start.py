"""The warm-started tiny model (model.warm_start): demonstrations become ids with a
loss mask on the trained model turns only, and the supervised steps are
deterministic and learn."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from rollout.tools import demonstrations
from training.config import ModelConfig
from training.tiny_model import (
    WARM_START_BATCH,
    build_tokenizer,
    encode_demonstration,
    tiny_llama_config,
    warm_start,
    write_tiny_model,
)


def test_a_demonstration_is_trained_on_its_trained_model_turns_and_their_eos():
    demo = [("prompt", "1+2=", False), ("model", "?", False), ("tool", ":3.", False)]
    demo.append(("model", "3", True))
    ids, mask = encode_demonstration(build_tokenizer(), demo)
    # <bos> 1 + 2 = | ? <eos> | : 3 . | 3 <eos>   (ids of the character vocabulary)
    assert ids == [1, 5, 25, 6, 24, 29, 2, 23, 7, 28, 7, 2]
    assert mask == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]


def test_warm_start_is_deterministic_and_lowers_the_loss(tmp_path):
    demos = demonstrations(20 * WARM_START_BATCH, seed=0)  # 20 steps
    a = write_tiny_model(tmp_path / "a", seed=0, demonstrations=demos)
    b = write_tiny_model(tmp_path / "b", seed=0, demonstrations=demos)
    plain = write_tiny_model(tmp_path / "plain", seed=0)
    weights = [(p / "model.safetensors").read_bytes() for p in (a, b, plain)]
    assert weights[0] == weights[1] != weights[2]

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer)))
    first = warm_start(model, tokenizer, demos[:WARM_START_BATCH])  # one step: about ln(30)
    last = warm_start(model, tokenizer, demos[WARM_START_BATCH:])
    print(f"warm-start loss: first step {first:.3f}, after 20 steps {last:.3f}")
    assert 3.0 < first < 3.8 and last < first - 1.0


def test_warm_start_is_refused_for_a_model_path():
    with pytest.raises(ValueError, match="unset model.path, or set model.warm_start: none"):
        ModelConfig(path="/models/qwen", warm_start="calculator")


def test_a_continued_run_keeps_its_warm_start_and_older_runs_resume(tmp_path):
    from tasks.config import ConfigError, RunConfig
    from tasks.context import RunContext
    from tasks.prepare import check_frozen

    def ctx(warm_start: str) -> RunContext:
        cfg = RunConfig.model_validate(
            {"storage": {"root": str(tmp_path)}, "model": {"warm_start": warm_start}}
        )
        return RunContext(cfg=cfg, base_model_path=str(tmp_path))

    snapshot = ctx("none").cfg.model_dump(mode="json")
    del snapshot["model"]["warm_start"]  # a run.json written before the key existed
    ctx("none").store.write_run_json({"config": snapshot})
    assert check_frozen(ctx("none")) is not None
    with pytest.raises(ConfigError, match="model.warm_start \\(was 'none', now 'calculator'\\)"):
        check_frozen(ctx("calculator"))
