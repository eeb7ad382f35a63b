"""Tensor-parallel sharding of the embedded engine's model: a 2-rank forward over
gloo gives the single-rank logits, and gathering the shards gives the full state
back byte for byte. The ranks are two threads of this process, each with its own
process group, as two engine ranks would be two processes."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engines.embedded import tensor_parallel as tpar
from engines.embedded.decode import ModelRunner
from wire import receiver as wr


def _qwen2_with_biases() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(cfg).eval()  # q/k/v carry biases: split with their rows


def _run_ranks(full: torch.nn.Module, tp: int, ids: torch.Tensor) -> list[torch.Tensor]:
    """Logits of a prefill plus one decode step on each of ``tp`` sharded copies."""
    port = wr.free_port()
    out: list[torch.Tensor | None] = [None] * tp
    errors: list[BaseException] = []
    state = full.state_dict()

    def rank(r: int) -> None:
        try:
            model = type(full)(full.config).eval()
            model.load_state_dict(state)
            group = wr.make_group("127.0.0.1", port, r, tp, "tp-test", "gloo")
            tpar.shard_model(model, r, tp, group)
            runner = ModelRunner(model)
            runner.begin()
            mask = torch.ones_like(ids)
            pos = torch.arange(ids.shape[1]).expand_as(ids)
            with torch.inference_mode():
                first = runner.forward(ids, mask, pos)
                nxt = first.argmax(-1, keepdim=True)
                mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
                second = runner.forward(nxt, mask, pos[:, -1:] + 1)
            out[r] = torch.stack([first, second])
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return out  # type: ignore[return-value]


@pytest.mark.parametrize("kind", ["llama-tiny", "qwen2-bias"])
def test_two_rank_forward_matches_one_rank(kind, tiny_model_dir):
    if kind == "llama-tiny":
        full = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    else:
        full = _qwen2_with_biases()
    ids = torch.tensor([[1, 5, 6, 7, 8], [1, 9, 10, 11, 12]])
    ref = _run_ranks(full, 1, ids)[0]
    got = _run_ranks(full, 2, ids)
    for logits in got:  # every rank ends with the full logits (lm_head is replicated)
        torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)


def test_shard_then_gather_is_identity():
    state = _qwen2_with_biases().state_dict()
    shards = [tpar.shard_state(state, r, 2) for r in range(2)]
    # Row-parallel weights are split by columns, column-parallel ones by rows.
    q = "model.layers.0.self_attn.q_proj.weight"
    o = "model.layers.0.self_attn.o_proj.weight"
    assert shards[0][q].shape[0] == state[q].shape[0] // 2
    assert shards[1][o].shape[1] == state[o].shape[1] // 2
    back = tpar.gather_state(shards)
    assert back.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(back[name], t), name


def test_indivisible_heads_are_refused_with_the_fix():
    cfg = _qwen2_with_biases().config  # 4 heads, 2 KV heads, intermediate 64
    with pytest.raises(tpar.TensorParallelError, match="tp_size=3 does not divide"):
        tpar.check_divisible(cfg, 3)
