"""The trainer scores a batch under the distribution the engine sampled it from.

The embedded engine reports each token's logprob under log_softmax(logits / T)
(before top-p/top-k: the full tempered distribution, as SGLang does). The
trainer must score the same tokens at the batch's own T, or the loss reads the
gap as a policy change. On CPU both sides hold the same fp32 weights, so
``rollout_logprob_kl`` is float noise at every T, and the mismatch gate
(``train.mismatch``) trips when the temperatures differ.
"""

from __future__ import annotations

import json

import pytest
import torch

from engines.config import EngineConfig
from engines.embedded.engine import EmbeddedEngine
from rollout.types import RolloutBatch, Sample
from storage.config import StorageConfig
from storage.run_store import RunStore
from training.actor import TrainActor
from training.config import (
    MismatchConfig,
    ModelConfig,
    RunIdentity,
    TrainConfig,
    TrainerSections,
    WeightsConfig,
)
from training.types import RolloutMismatchError, mismatch_message

PROMPTS = [[1, 5, 25, 6, 24], [1, 14, 15, 16, 22], [1, 7, 8, 9], [1, 20, 21]]
N = 4


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> EmbeddedEngine:
    return EmbeddedEngine(str(tiny_model_dir), 0, EngineConfig(), weight_version=0)


def engine_batch(engine, temperature: float, recorded: float | None, **filters) -> RolloutBatch:
    """Batch 1 sampled by the engine at ``temperature`` (v0), with ``recorded`` as the
    temperature the batch says it was sampled at."""
    samples = []
    for p, prompt in enumerate(PROMPTS):
        params = [
            {"temperature": temperature, "max_new_tokens": 10, "sampling_seed": 100 * p + j}
            | filters
            for j in range(N)
        ]
        for j, out in enumerate(engine.generate([prompt] * N, params)):
            lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
            reward = float(j % 2)  # every group informative: the loss has tokens to weigh
            samples.append(
                Sample(p, j, prompt, out["output_ids"], lps, reward, 0, "length", out["text"])
            )
    return RolloutBatch(1, N, samples, temperature=recorded)


def trainer(tmp_path, model_dir, mismatch: MismatchConfig | None = None) -> TrainActor:
    storage = StorageConfig(root=str(tmp_path / "runs"))
    train = TrainConfig(micro_batch_size=8, lr=1e-3, mismatch=mismatch or MismatchConfig())
    sections = TrainerSections(
        train=train, model=ModelConfig(), storage=storage, weights=WeightsConfig()
    )
    actor = TrainActor(RunIdentity(name="tau", seed=0, namespace="t"), sections, 0, "", 0)
    actor.setup()
    actor.init_from_base(str(model_dir))
    return actor


def train_on(tmp_path, model_dir, batch: RolloutBatch, mismatch=None) -> dict:
    actor = trainer(tmp_path, model_dir, mismatch)
    RunStore(actor.storage_cfg, "tau").write_rollouts(1, batch.to_json())
    return actor.train_step(1)


@pytest.mark.parametrize("temperature", [0.5, 0.7, 1.0])
@pytest.mark.parametrize("filters", [{}, {"top_p": 0.8}, {"top_k": 5}], ids=str)
def test_trainer_and_engine_agree_at_the_sampling_temperature(
    tmp_path, tiny_model_dir, engine, temperature, filters
):
    batch = engine_batch(engine, temperature, temperature, **filters)
    m = train_on(tmp_path, tiny_model_dir, batch)
    assert m["temperature"] == temperature
    assert m["rollout_logprob_kl"] <= 1e-6
    assert m["rollout_logprob_abs_diff"] <= 1e-4
    assert m["rollout_logprob_kl_over"] is False


def test_a_batch_scored_at_another_temperature_trips_the_gate(tmp_path, tiny_model_dir, engine):
    # Sampled at 0.5 but recorded as a batch of before the temperature was stored:
    # the trainer scores it at 1.0, as it did then, and the gap is far above float noise.
    batch = engine_batch(engine, 0.5, None)
    m = train_on(tmp_path / "warn", tiny_model_dir, batch)
    assert m["temperature"] == 1.0
    assert m["rollout_logprob_kl"] > 0.01
    assert m["rollout_logprob_kl_over"] is True
    assert m["iteration"] == 1  # warn: the step is taken

    actor = trainer(tmp_path / "error", tiny_model_dir, MismatchConfig(on_exceed="error"))
    RunStore(actor.storage_cfg, "tau").write_rollouts(1, batch.to_json())
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    with pytest.raises(RolloutMismatchError, match=r"train\.mismatch\.max_kl.*sampled at 1"):
        actor.train_step(1)
    assert actor.iteration() == 0  # no optimizer step: still the weights that made the batch
    assert all(torch.equal(before[k], v) for k, v in actor.model.state_dict().items())

    m = train_on(tmp_path / "off", tiny_model_dir, batch, MismatchConfig(max_kl=None))
    assert m["rollout_logprob_kl_over"] is None


def test_the_gate_names_compiled_lora_layers_first_where_a_run_has_them():
    # Measured on its own (one H100, SGLang): compiled LoRA layers hold the gap at 0.017.
    plain = mismatch_message(3, 0.0108, 0.01, 0.8)
    assert plain.startswith("rollout_logprob_kl 0.0108 at iteration 3 is above")
    assert "Usual causes: the temperature (the batch was sampled at 0.8" in plain
    assert "compile_layers" not in plain
    named = mismatch_message(3, 0.0108, 0.01, 0.8, compiled_lora=True)
    assert "set train.compile_layers: auto. Other causes: the temperature" in named
    assert named.endswith("to train anyway")


def test_off_policy_batches_are_not_gated(tmp_path, tiny_model_dir, engine):
    # A batch of v0 trained by a trainer that holds v1: the gap is learning, not mismatch.
    batch = engine_batch(engine, 0.5, None)
    actor = trainer(tmp_path, tiny_model_dir, MismatchConfig(on_exceed="error"))
    store = RunStore(actor.storage_cfg, "tau")
    store.write_rollouts(1, engine_batch(engine, 0.5, 0.5).to_json())
    store.write_rollouts(2, RolloutBatch(2, N, batch.samples).to_json())
    actor.train_step(1)
    assert actor.train_step(2)["rollout_logprob_kl_over"] is None


def test_the_batch_keeps_its_temperature_on_disk(engine):
    batch = engine_batch(engine, 0.7, 0.7)
    data = json.loads(json.dumps(batch.to_json()))
    assert data["temperature"] == 0.7
    assert RolloutBatch.from_json(data).train_temperature == 0.7
    # A batch persisted before the temperature was recorded reads as it was trained: 1.0.
    del data["temperature"]
    assert RolloutBatch.from_json(data).train_temperature == 1.0
    assert "temperature" not in RolloutBatch(1, N, batch.samples).to_json()
    for bad in (0, -0.5, "0.7", True):
        with pytest.raises(ValueError, match="rerun rollout"):
            RolloutBatch.from_json({**data, "temperature": bad})
