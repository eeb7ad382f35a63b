"""Build megatron-core's GPTModel on CPU (use_cpu_initialization) and load converted
weights. Needs megatron-core; megatron's forward needs CUDA, so none runs here."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from mcore_helpers import hf_state, tiny_model  # noqa: E402

from training.megatron.convert import spec_from_hf_config  # noqa: E402
from training.megatron.model import (  # noqa: E402
    build_gpt,
    check_layout,
    full_hf_state,
    init_parallel,
    load_hf_state,
    wrap,
)


@pytest.fixture(scope="module")
def parallel_state():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    owned = not dist.is_initialized()
    init_parallel(0, 1, "127.0.0.1", 0, 1, 1, seed=0, device=torch.device("cpu"))
    yield ps
    ps.destroy_model_parallel()
    if owned:
        dist.destroy_process_group()


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", False), ("qwen2", True)])
def test_build_on_cpu_and_load_converted_weights(parallel_state, family, tied):
    model = tiny_model(family, tied)
    gpt = build_gpt(model.config, "float32", 1, 1, torch.device("cpu"))
    view = wrap(gpt, model.config, "float32")
    hf = hf_state(model)
    load_hf_state(gpt, hf, tp=1, tp_rank=0)  # strict: every megatron tensor is matched
    assert sum(p.numel() for p in view.parameters()) == sum(p.numel() for p in model.parameters())
    back = full_hf_state(gpt, tp=1)
    assert sorted(back) == sorted(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name
    attn = gpt.decoder.layers[0].self_attention
    assert (attn.linear_qkv.bias is not None) == (family == "qwen2")


def test_bf16_build_goes_through_float16module(parallel_state):
    from megatron.core.transformer.module import Float16Module

    model = tiny_model("qwen2")
    gpt = build_gpt(model.config, "bfloat16", 1, 1, torch.device("cpu"))
    view = wrap(gpt, model.config, "bfloat16")
    load_hf_state(gpt, hf_state(model), tp=1, tp_rank=0)
    assert isinstance(view.module, Float16Module)
    assert {p.dtype for p in view.parameters()} == {torch.bfloat16}
    back = full_hf_state(gpt, tp=1)
    for name, t in hf_state(model).items():
        assert torch.equal(back[name], t.to(torch.bfloat16)), name


def test_layout_refuses_pipeline_parallel_and_bad_world_sizes():
    spec = spec_from_hf_config(tiny_model("llama").config)
    assert check_layout(4, 2, 1, spec) == 2
    with pytest.raises(ValueError, match="pipeline_parallel: 1"):
        check_layout(2, 1, 2, spec)
    with pytest.raises(ValueError, match="multiple of"):
        check_layout(3, 2, 1, spec)


def test_a_background_snapshot_is_written_as_it_was_taken(parallel_state, tmp_path):
    """The megatron checkpoint goes through the same snapshot + write as the torch
    backend's, so it can be written in the background: what is written is the state
    when the snapshot was taken, though the model and optimizer step on meanwhile,
    and it loads back into a fresh model (in HF names) and optimizer."""
    from storage.config import StorageConfig
    from storage.run_store import RunStore
    from training import checkpoint
    from training.megatron import checkpoint as mcheckpoint

    model = tiny_model("qwen2")
    gpt = build_gpt(model.config, "float32", 1, 1, torch.device("cpu"))
    wrap(gpt, model.config, "float32")
    load_hf_state(gpt, hf_state(model), tp=1, tp_rank=0)
    optim = torch.optim.AdamW(gpt.parameters(), lr=0.1)

    def step() -> None:  # no forward on CPU: gradients set by hand, then a real AdamW step
        for p in gpt.parameters():
            p.grad = torch.ones_like(p)
        optim.step()

    step()
    snap = mcheckpoint.snapshot(gpt, optim, copy=True)
    taken = {n: t.clone() for n, t in full_hf_state(gpt, tp=1).items()}
    step()  # training goes on while the write is in flight
    store = RunStore(StorageConfig(root=str(tmp_path)), "mbg")
    meta = checkpoint.write(store, 1, snap, {"iteration": 1, **mcheckpoint.meta_extra()})
    assert meta["backend"] == "megatron" and store.committed_checkpoints() == [1]
    store.verify_checkpoint(1)

    fresh = build_gpt(model.config, "float32", 1, 1, torch.device("cpu"))
    wrap(fresh, model.config, "float32")
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    assert mcheckpoint.load(store, 1, fresh, fresh_optim)["iteration"] == 1
    back = full_hf_state(fresh, tp=1)
    assert all(torch.equal(back[n], t) for n, t in taken.items())
    assert not all(torch.equal(full_hf_state(gpt, tp=1)[n], t) for n, t in taken.items())
    assert fresh_optim.state_dict()["state"][0]["step"] == 1  # the snapshot's, not step 2's
