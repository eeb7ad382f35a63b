"""``train.compute_dtype: bfloat16`` over fp32 weights on one rank: the forward
runs on the bf16 cast of the master weights (what an engine serving bf16 holds
after a push), the update stays fp32, and a run restored from a checkpoint
takes the same steps to the same bytes."""

from __future__ import annotations

import pytest
import torch
from train_helpers import synthetic_batch
from transformers import AutoModelForCausalLM

from storage.config import StorageConfig
from storage.run_store import RunStore
from training.actor import TrainActor
from training.config import ModelConfig, RunIdentity, TrainConfig, TrainerSections, WeightsConfig
from training.mixed_precision import ComputeCopy

IDS = [[1, 5, 25, 6, 24, 7, 8, 9, 10, 11]]


def actor(root, model_dir, **train) -> TrainActor:
    storage = StorageConfig(root=str(root))
    cfg = TrainConfig(micro_batch_size=6, lr=1e-3, compute_dtype="bfloat16", **train)
    sections = TrainerSections(
        train=cfg, model=ModelConfig(), storage=storage, weights=WeightsConfig()
    )
    a = TrainActor(RunIdentity(name="mp", seed=3, namespace="t"), sections, 0, "", 0)
    a.setup()
    a.init_from_base(str(model_dir))
    store = RunStore(storage, "mp")
    for k in (1, 2, 3):
        if store.read_rollouts(k) is None:
            store.write_rollouts(k, synthetic_batch(k).to_json())
    return a


def logprobs(model, temperature: float) -> torch.Tensor:
    ids = torch.tensor(IDS)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def test_the_trainer_scores_the_bf16_cast_and_steps_the_fp32_master(tmp_path, tiny_model_dir):
    a = actor(tmp_path, tiny_model_dir, loss={"kl_coef": 0.05})
    for k in (1, 2):
        a.train_step(k)
    master = a._hf_state()
    assert {t.dtype for t in master.values()} == {torch.float32}
    assert {p.dtype for p in a.ref_model.parameters()} == {torch.bfloat16}
    assert all(s["exp_avg"].dtype == torch.float32 for s in a.optim.state.values())
    # What an engine serving bf16 holds after a push: the master, cast.
    served = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    served.load_state_dict({k: v.to(torch.bfloat16) for k, v in master.items()}, strict=False)
    fp32 = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    fp32.load_state_dict(master, strict=False)
    got = a.score(IDS, temperature=0.7)
    assert torch.allclose(got, logprobs(served, 0.7), atol=1e-5)
    assert (got - logprobs(fp32, 0.7)).abs().max() > 1e-4  # not the fp32 weights


def test_a_restored_run_takes_the_same_steps(tmp_path, tiny_model_dir):
    whole = actor(tmp_path / "a", tiny_model_dir)
    for k in (1, 2, 3):
        whole.train_step(k)
    first = actor(tmp_path / "b", tiny_model_dir)
    first.train_step(1)
    first.train_step(2)
    first.save_checkpoint(2)
    resumed = actor(tmp_path / "b", tiny_model_dir)
    assert resumed.load_checkpoint(2) == 2
    resumed.train_step(3)
    want, got = whole._hf_state(), resumed._hf_state()
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_equal_dtypes_need_no_copy(tmp_path, tiny_model_dir, dtype):
    storage = StorageConfig(root=str(tmp_path))
    cfg = TrainConfig(compute_dtype=dtype)
    sections = TrainerSections(
        train=cfg, model=ModelConfig(dtype=dtype), storage=storage, weights=WeightsConfig()
    )
    a = TrainActor(RunIdentity(name="mp", seed=3, namespace="t"), sections, 0, "", 0)
    a.init_from_base(str(tiny_model_dir))
    assert a._compute is None


def test_gradients_add_up_in_fp32_over_micro_batches(tiny_model_dir):
    """Each micro-batch's bf16 gradients are added into the master's fp32 ones, so
    the sum is the fp32 sum of the bf16 gradients (never rounded to bf16 between
    micro-batches), and a rank between steps holds none."""
    master = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    twin = ComputeCopy(master, torch.bfloat16)
    ids = torch.tensor(IDS)
    want: dict[str, torch.Tensor] = {}
    for scale in (1.0, 1e-3, 1e3):
        twin.refresh()
        (twin.model(input_ids=ids).logits.float().mean() * scale).backward()
        for name, p in twin.model.named_parameters():
            g = p.grad.to(torch.float32)
            want[name] = want[name] + g if name in want else g
        twin.collect_grads()
        assert all(p.grad is None for p in twin.model.parameters())
    got = dict(master.named_parameters())
    assert all(torch.equal(got[n].grad, want[n]) for n in want)
    twin.zero_grad()
    assert all(p.grad is None for p in master.parameters())


def test_a_twin_built_apart_starts_from_the_master_and_must_match_its_layout(tiny_model_dir):
    # megatron builds its bf16 compute model itself (through Float16Module): whatever
    # it was initialised to, the copy scores the master's weights from the start.
    master = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    twin = AutoModelForCausalLM.from_config(master.config).to(torch.bfloat16)
    copy = ComputeCopy(master, torch.bfloat16, twin)
    assert copy.model is twin
    for m, c in zip(master.parameters(), twin.parameters(), strict=True):
        assert torch.equal(c, m.to(torch.bfloat16))
    with pytest.raises(ValueError, match="not the master's layout"):
        ComputeCopy(master, torch.bfloat16, AutoModelForCausalLM.from_config(master.config))
