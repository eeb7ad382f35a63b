"""HF <-> Megatron conversion and TP split/gather: pure torch, runs in CI."""

from __future__ import annotations

import pytest
import torch
from mcore_helpers import hf_state, tiny_config, tiny_model

from training.megatron.convert import (
    check_tp,
    fuse_qkv,
    gather_tp,
    hf_to_megatron,
    megatron_to_hf,
    spec_from_hf_config,
    split_qkv,
    split_tp,
    stream_megatron_to_hf,
)

CASES = [("llama", False), ("qwen2", False), ("qwen2", True), ("llama", True)]


def assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(torch.uint8), b[name].contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("family,tied", CASES)
def test_hf_megatron_hf_round_trip_is_bit_exact(family, tied):
    model = tiny_model(family, tied)
    spec = spec_from_hf_config(model.config)
    hf = hf_state(model)
    m = hf_to_megatron(hf, spec)
    layer = "decoder.layers.0."
    assert (layer + "self_attention.linear_qkv.bias" in m) == (family == "qwen2")
    assert ("output_layer.weight" in m) == (not tied)
    assert m[layer + "self_attention.linear_qkv.weight"].shape == ((8 + 2 * 2) * 8, 64)
    assert m[layer + "mlp.linear_fc1.weight"].shape == (2 * 96, 64)
    assert_bit_exact(megatron_to_hf(m, spec), hf)


def test_round_trip_is_bit_exact_in_bf16():
    model = tiny_model("qwen2").to(torch.bfloat16)
    spec = spec_from_hf_config(model.config)
    hf = hf_state(model)
    assert_bit_exact(megatron_to_hf(hf_to_megatron(hf, spec), spec), hf)


def test_spec_reads_config_json_dict():
    cfg = tiny_config("qwen2", tied=True)
    assert spec_from_hf_config(cfg.to_dict()) == spec_from_hf_config(cfg)


def test_qkv_is_interleaved_by_query_group():
    # 4 heads in 2 groups, head dim 1: rows are labelled by what they are.
    spec = spec_from_hf_config(
        dict(
            model_type="llama",
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_size=4,
            head_dim=1,
            num_hidden_layers=1,
            intermediate_size=4,
            vocab_size=8,
        )
    )
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # q heads 0..3
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = fuse_qkv(q, k, v, spec)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    for a, b in zip(split_qkv(fused, spec), (q, k, v)):
        assert torch.equal(a, b)


def test_fused_qkv_matmul_matches_separate_projections():
    model = tiny_model("qwen2")
    spec = spec_from_hf_config(model.config)
    attn = model.model.layers[0].self_attn
    m = hf_to_megatron(hf_state(model), spec)
    x = torch.randn(3, 64)
    fused = x @ m["decoder.layers.0.self_attention.linear_qkv.weight"].T
    fused = fused + m["decoder.layers.0.self_attention.linear_qkv.bias"]
    g = fused.view(3, 2, (4 + 2) * 8)  # [tokens, groups, (q heads of group + k + v) * d]
    q = g[..., : 4 * 8].reshape(3, -1)
    k, v = g[..., 32:40].reshape(3, -1), g[..., 40:].reshape(3, -1)
    torch.testing.assert_close(q, attn.q_proj(x), rtol=0, atol=1e-6)
    torch.testing.assert_close(k, attn.k_proj(x), rtol=0, atol=1e-6)
    torch.testing.assert_close(v, attn.v_proj(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("family,tied", CASES)
def test_tp2_split_and_gather_round_trip(family, tied):
    model = tiny_model(family, tied)
    spec = spec_from_hf_config(model.config)
    check_tp(spec, 2)
    full = hf_to_megatron(hf_state(model), spec)
    shards = split_tp(full, 2)
    layer = "decoder.layers.1."
    s0 = shards[0]
    assert s0[layer + "self_attention.linear_qkv.weight"].shape == (48, 64)  # one query group
    assert s0[layer + "self_attention.linear_proj.weight"].shape == (64, 32)
    assert s0[layer + "mlp.linear_fc1.weight"].shape == (96, 64)
    assert s0[layer + "mlp.linear_fc2.weight"].shape == (64, 48)
    assert s0["embedding.word_embeddings.weight"].shape == (48, 64)
    assert torch.equal(s0[layer + "input_layernorm.weight"], full[layer + "input_layernorm.weight"])
    # rank 0's fc1 holds the first half of gate, then the first half of up
    gate, up = full[layer + "mlp.linear_fc1.weight"].chunk(2)
    assert torch.equal(s0[layer + "mlp.linear_fc1.weight"], torch.cat([gate[:48], up[:48]]))
    # rank 1's qkv is exactly query group 1
    qkv = full[layer + "self_attention.linear_qkv.weight"]
    assert torch.equal(shards[1][layer + "self_attention.linear_qkv.weight"], qkv[48:])
    assert_bit_exact(gather_tp(shards), full)
    assert_bit_exact(megatron_to_hf(gather_tp(shards), spec), hf_state(model))


def test_tp_that_does_not_divide_names_the_fix():
    spec = spec_from_hf_config(tiny_config("llama"))
    with pytest.raises(ValueError, match="tensor_parallel"):
        check_tp(spec, 4)  # 2 KV heads


def test_unmapped_or_unsupported_weights_are_refused():
    model = tiny_model("llama")
    spec = spec_from_hf_config(model.config)
    with pytest.raises(KeyError, match="no megatron mapping"):
        hf_to_megatron({**hf_state(model), "model.extra.weight": torch.zeros(1)}, spec)
    with pytest.raises(ValueError, match="train.backend: torch"):
        spec_from_hf_config({"model_type": "gpt2"})


@pytest.mark.parametrize("family,tied", CASES)
def test_streamed_conversion_skips_extra_state_and_holds_one_layer(family, tied):
    """A push walks the raw megatron state dict (``_extra_state`` entries hold None)
    and gets HF tensors layer by layer, never reading ahead more than one tensor."""
    model = tiny_model(family, tied)
    spec = spec_from_hf_config(model.config)
    hf = hf_state(model)
    raw: list[tuple[str, object]] = []
    for name, t in hf_to_megatron(hf, spec).items():
        raw.append((name, t))
        if name.startswith("decoder.layers."):
            raw.append((name.rsplit(".", 1)[0] + "._extra_state", None))
    read = []

    def items():
        for item in raw:
            read.append(item[0])
            yield item

    out = {}
    for name, t in stream_megatron_to_hf(items(), spec):
        if name.startswith("model.layers.0."):  # layer 0 is out once layer 1 begins
            assert sum(n.startswith("decoder.layers.1.") for n in read) == 1, name
        out[name] = t
    assert_bit_exact(out, hf)
