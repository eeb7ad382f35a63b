"""``train.lora``: the trainer steps only the adapters, scores the KL reference on
the base (adapters off, no second model), publishes versions that hold only the
adapters as peft saves them (a few percent of the model), which ``prefect-rl
materialize`` merges into a plain HF model, and a restored run takes the same steps
to the same bytes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import safetensors.torch
import torch
from pydantic import ValidationError
from train_helpers import synthetic_batch
from transformers import AutoModelForCausalLM

from flows import cli
from storage.config import StorageConfig
from storage.run_store import RunStore
from training.actor import TrainActor
from training.config import ModelConfig, RunIdentity, TrainConfig, TrainerSections, WeightsConfig
from training.lora import lora_layers

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


def publish_base(store: RunStore, model_dir) -> None:
    """v0, the base model, as ``prepare_run`` publishes it."""
    w = store.weights_writer(0, iteration=0, parent=None)
    for f in sorted(Path(model_dir).iterdir()):
        w.add_file(f.name, str(f))
    w.commit()


def peft_merged(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """peft's own merge of an adapted model (each layer's ``merge``), in HF names."""
    m = copy.deepcopy(model)
    for layer in lora_layers(m):
        layer.merge()
    return {n.replace(".base_layer", ""): t for n, t in m.state_dict().items() if "lora_" not in n}


def test_only_the_adapters_train_and_a_version_holds_them_as_peft_saves_them(
    tmp_path, tiny_model_dir
):
    a = actor(tmp_path, tiny_model_dir, loss={"kl_coef": 0.05})
    assert a.ref_model is None  # the reference is the base, adapters off
    trained = {n for group in a.optim.param_groups for p in group["params"] for n in [id(p)]}
    names = {id(p): n for n, p in a.model.named_parameters()}
    assert trained and all("lora_" in names[i] for i in trained)
    # A version holds only the adapters, in peft's names; B starts at zero, so the
    # adapted model is the base.
    published = a._hf_state()
    modules = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in published}
    assert all(n.startswith("base_model.model.model.layers.") for n in published)
    assert modules == set(LORA["target_modules"])
    assert all(not t.any() for n, t in published.items() if ".lora_B." in n)
    first = a.train_step(1)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 1
    assert a.train_step(2)["kl"] > 1e-6  # the reference stays the base: adapters off
    store = a.store()
    publish_base(store, tiny_model_dir)
    a.export_hf(2, 2, 1)
    m = store.read_manifest(2)
    assert m.adapter is not None and m.adapter.base == 0
    assert m.adapter.base_digest == store.read_manifest(0).digest()
    assert sorted(f.name for f in m.files) == ["adapter_config.json", "adapter_model.safetensors"]
    # peft loads the version folder as its own adapter and scores as the trainer does
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    served = PeftModel.from_pretrained(base, store.local_version_dir(2)).eval()
    ids = torch.tensor(IDS)
    with torch.no_grad():
        logits = served(input_ids=ids).logits[:, :-1].float() / 0.7
    want = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert torch.allclose(a.score(IDS, temperature=0.7), want, atol=1e-5)


def test_the_export_merges_an_adapter_version_into_a_plain_hf_model(tmp_path, tiny_model_dir):
    a = actor(tmp_path, tiny_model_dir)
    a.train_step(1)
    store = a.store()
    publish_base(store, tiny_model_dir)
    a.export_hf(1, 1, 0)
    root = ["--root", str(tmp_path)]
    assert cli.main(["materialize", "lora", "1", str(tmp_path / "merged"), *root]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    want = peft_merged(a.model)
    assert set(exported) == set(want)
    assert all(torch.allclose(exported[n], want[n], atol=1e-5) for n in want)
    assert not (tmp_path / "merged" / "manifest.json").exists()  # not a committed version
    # --adapter-only: the peft folder as it is, verified
    assert (
        cli.main(["materialize", "lora", "1", str(tmp_path / "peft"), "--adapter-only", *root]) == 0
    )
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "manifest.json",
    ]


def test_an_adapter_version_is_a_few_percent_of_the_model(tmp_path, tiny_model_dir):
    """Rank 8 on the attention's q and v (peft's classic choice) of the tiny model
    (hidden size 64, so rank 8 is an eighth of it: an adapter of every linear layer
    would be a fifth of this model)."""
    lora = {"rank": 8, "target_modules": ["q_proj", "v_proj"]}
    a = actor(tmp_path, tiny_model_dir, lora=lora)
    store = a.store()
    publish_base(store, tiny_model_dir)
    a.export_hf(1, 1, 0)
    adapter = {f.name: f.bytes for f in store.read_manifest(1).files}
    model = {f.name: f.bytes for f in store.read_manifest(0).files}
    # 2 layers x (q: 8 x (64 + 64) + v: 8 x (64 + 32)) float32 values, and the header
    assert 14_336 < adapter["adapter_model.safetensors"] < 14_336 + 2_048
    assert adapter["adapter_model.safetensors"] <= 0.05 * model["model.safetensors"]


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


def test_every_decoder_layer_sees_an_input_that_needs_a_gradient(tmp_path, tiny_model_dir):
    # The frozen embedding's output needs none, so without the adapters' hook the first
    # layer's input would differ from every other layer's: compiled layers recompiled
    # per case until torch.compile's recompile limit sent the rest back to eager (seen
    # on an H100). Where no gradient is taken, none is asked for.
    from training.backend_torch import decoder_layers

    a = actor(tmp_path, tiny_model_dir, compute_dtype="bfloat16")
    seen: list[bool] = []
    policy = a._policy()  # the bf16 copy the step runs: it keeps the hook
    hooks = [
        layer.register_forward_pre_hook(
            lambda m, args, kw: seen.append(args[0].requires_grad), with_kwargs=True
        )
        for layer in decoder_layers(policy)
    ]
    try:
        policy(input_ids=torch.tensor(IDS))
        assert seen and all(seen)
        seen.clear()
        with torch.no_grad():
            policy(input_ids=torch.tensor(IDS))
        assert seen and not any(seen)
    finally:
        for h in hooks:
            h.remove()
