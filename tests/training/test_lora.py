"""``train.lora``: the trainer steps only the adapters, scores the KL reference on
the base (adapters off, no second model), publishes the merged weights an engine
loads as a plain HF checkpoint, and a restored run takes the same steps to the
same bytes."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from pydantic import ValidationError
from train_helpers import synthetic_batch
from transformers import AutoModelForCausalLM

from storage.config import StorageConfig
from storage.run_store import RunStore
from training.actor import TrainActor
from training.config import ModelConfig, RunIdentity, TrainConfig, TrainerSections, WeightsConfig

IDS = [[1, 5, 25, 6, 24, 7, 8, 9, 10, 11]]
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def actor(root, model_dir, lora=LORA, **train) -> TrainActor:
    storage = StorageConfig(root=str(root))
    cfg = TrainConfig(micro_batch_size=6, lr=1e-2, lora=lora, **train)
    sections = TrainerSections(
        train=cfg, model=ModelConfig(), storage=storage, weights=WeightsConfig()
    )
    a = TrainActor(RunIdentity(name="lora", seed=3, namespace="t"), sections, 0, "", 0)
    a.setup()
    a.init_from_base(str(model_dir))
    store = RunStore(storage, "lora")
    for k in (1, 2, 3):
        if store.read_rollouts(k) is None:
            store.write_rollouts(k, synthetic_batch(k).to_json())
    return a


def test_only_the_adapters_train_and_the_merged_weights_load_as_hf(tmp_path, tiny_model_dir):
    a = actor(tmp_path, tiny_model_dir, loss={"kl_coef": 0.05})
    assert a.ref_model is None  # the reference is the base, adapters off
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    base_state = base.state_dict()
    trained = {n for group in a.optim.param_groups for p in group["params"] for n in [id(p)]}
    names = {id(p): n for n, p in a.model.named_parameters()}
    assert trained and all("lora_" in names[i] for i in trained)
    # B starts at zero: the adapted model is the base, and so is its published state.
    assert all(torch.equal(v, base_state[k]) for k, v in a._hf_state().items())
    first = a.train_step(1)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 1
    assert a.train_step(2)["kl"] > 1e-6  # the reference stays the base: adapters off
    merged = a._hf_state()
    assert set(merged) == set(base_state) - {"lm_head.weight"} or set(merged) == set(base_state)
    changed = {k for k, v in merged.items() if not torch.equal(v, base_state[k])}
    assert changed and all(k.rsplit(".", 2)[-2] in LORA["target_modules"] for k in changed)
    # An engine loads the merged state as a plain HF model and scores as the trainer does.
    served = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    served.load_state_dict(merged, strict=False)
    ids = torch.tensor(IDS)
    with torch.no_grad():
        logits = served(input_ids=ids).logits[:, :-1].float() / 0.7
    want = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert torch.allclose(a.score(IDS, temperature=0.7), want, atol=1e-5)


def test_a_restored_lora_run_takes_the_same_steps(tmp_path, tiny_model_dir):
    whole = actor(tmp_path / "a", tiny_model_dir)
    for k in (1, 2, 3):
        whole.train_step(k)
    first = actor(tmp_path / "b", tiny_model_dir)
    first.train_step(1)
    first.train_step(2)
    first.save_checkpoint(2)
    # The checkpoint holds what training changed: the adapters, not the frozen base.
    with first.store().open_checkpoint_file(2, "model.safetensors") as f:
        saved = safetensors.torch.load(f.read())
    assert saved and all("lora_" in name for name in saved)
    resumed = actor(tmp_path / "b", tiny_model_dir)
    assert resumed.load_checkpoint(2) == 2
    resumed.train_step(3)
    want, got = whole._hf_state(), resumed._hf_state()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_target_module_the_model_lacks_is_refused_with_its_linear_layers(
    tmp_path, tiny_model_dir
):
    with pytest.raises(ValueError, match=r"qkv_proj.*linear layers are \[.*q_proj"):
        actor(tmp_path, tiny_model_dir, lora={"target_modules": ["qkv_proj"]})


@pytest.mark.parametrize(
    ("train", "match"),
    [
        ({"lora": {"rank": 0}}, "greater than or equal to 1"),
        ({"lora": {"target_modules": []}}, "at least 1 item"),
        ({"lora": {"target_modules": ["model.layers.0.q_proj"]}}, "not a dotted path"),
        ({"lora": {}, "backend": "megatron"}, "train.lora needs backend: torch"),
        ({"lora": {"rank": 4, "extra": 1}}, "Extra inputs"),
    ],
)
def test_bad_lora_settings_are_refused_at_load(train, match):
    with pytest.raises(ValidationError, match=match):
        TrainConfig(**train)


def test_a_continued_run_cannot_change_its_adapters(tmp_path):
    """Its checkpoints hold only the adapters: a continued run with other LoRA
    settings, or none, is refused before any state, naming what changed."""
    from tasks.config import ConfigError, RunConfig
    from tasks.context import RunContext
    from tasks.prepare import check_frozen

    def ctx(lora: dict | None) -> RunContext:
        cfg = RunConfig.model_validate(
            {"storage": {"root": str(tmp_path)}, "train": {"lora": lora}}
        )
        return RunContext(cfg=cfg, base_model_path=str(tmp_path))

    first = ctx({"rank": 4})
    first.store.write_run_json({"config": first.cfg.model_dump(mode="json")})
    assert check_frozen(ctx({"rank": 4})) is not None
    with pytest.raises(ConfigError, match=r"train.lora \(was .*'rank': 4.*, now .*'rank': 8"):
        check_frozen(ctx({"rank": 8}))
    with pytest.raises(ConfigError, match=r"train.lora \(was .*'rank': 4.*, now None\)"):
        check_frozen(ctx(None))
