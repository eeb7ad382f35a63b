"""The passes a trainer runs while it is built, so torch.compile builds a step's
kernels before the first step (``training.warm_up``), leave nothing behind: the
first step of a warmed trainer is byte for byte a cold one's."""

from __future__ import annotations

import torch
from train_helpers import synthetic_batch

from storage.config import StorageConfig
from storage.run_store import RunStore
from training.actor import TrainActor
from training.config import ModelConfig, RunIdentity, TrainConfig, TrainerSections, WeightsConfig
from training.warm_up import warm_up_batch


def built(root, model_dir, name: str) -> TrainActor:
    storage = StorageConfig(root=str(root))
    # KL on (the reference model's pass) and bf16 compute (the copy's gradients)
    cfg = TrainConfig(micro_batch_size=6, lr=1e-3, compute_dtype="bfloat16", loss={"kl_coef": 0.05})
    sections = TrainerSections(
        train=cfg, model=ModelConfig(), storage=storage, weights=WeightsConfig()
    )
    a = TrainActor(RunIdentity(name=name, seed=3, namespace="t"), sections, 0, "", 0)
    a.setup()
    a.init_from_base(str(model_dir))
    RunStore(storage, name).write_rollouts(1, synthetic_batch(1).to_json())
    return a


def test_the_warm_up_passes_leave_the_first_step_unchanged(tmp_path, tiny_model_dir):
    cold = built(tmp_path, tiny_model_dir, "cold")
    warm = built(tmp_path, tiny_model_dir, "warm")
    rng = torch.get_rng_state()
    warm._compile_now()  # what init_from_base runs where a step's kernels are compiled
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in warm.model.parameters()) and not warm.optim.state
    assert cold.train_step(1) | {"train_s": 0, "tokens_per_s": 0} == warm.train_step(1) | {
        "train_s": 0,
        "tokens_per_s": 0,
    }
    a, b = cold._hf_state(), warm._hf_state()
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_the_warm_up_batch_fits_any_vocabulary():
    batch = warm_up_batch(vocab_size=5, temperature=0.7)
    assert batch.train_temperature == 0.7 and len(batch.samples) == 4
    assert max(t for s in batch.samples for t in s.prompt_ids + s.response_ids) < 5
    assert len({s.reward for s in batch.samples}) == 2  # advantages are not all zero
