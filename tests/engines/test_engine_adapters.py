"""The embedded engine serves LoRA adapter versions: v0's weights stay its base, and
adapter ``v{k}`` (a peft folder verified against its manifest, or one flattened bucket
of tensors) makes it serve base + scale * B @ A as version k. A damaged adapter, one
trained on another base, or a full version named as an adapter is refused with the
old weights and version still serving.

Versions are published with the trainer's own writer (``training.export``) into a
real run store; disk loads go over real HTTP to the engine's server."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.client import EngineClient, EngineHTTPError
from engines.config import EngineConfig
from engines.embedded.engine import EmbeddedEngine
from engines.embedded.http_server import ServerSettings, serve_in_thread
from storage import RunStore, StorageConfig
from storage.layout import ADAPTER_WEIGHTS
from training.config import LoraConfig
from training.export import write_adapter
from training.lora import adapter_state, add_adapters, lora_layers, peft_config
from training.weight_sender import ShmSegment
from wire.flat_bucket import flatten
from wire.lora import checksums

PROMPT = [1, 5, 6, 7, 25, 8]
GREEDY = {"max_new_tokens": 6, "temperature": 0}


def publish_dir(store: RunStore, version: int, src) -> None:
    w = store.weights_writer(version, version, None)
    for f in sorted(src.iterdir()):
        w.add_file(f.name, str(f))
    w.commit()


def trained_adapter(tiny_dir, cfg: LoraConfig, seed: int) -> torch.nn.Module:
    """The tiny model with adapters whose B is no longer zero, as after training."""
    model = add_adapters(AutoModelForCausalLM.from_pretrained(tiny_dir), cfg, seed)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed)
        for layer in lora_layers(model):
            layer.lora_B["default"].weight.normal_(0, 0.05)
    return model


def publish_adapter(store: RunStore, version: int, model, cfg: LoraConfig, base: str) -> None:
    w = store.weights_writer(version, version, version - 1)
    write_adapter(w, adapter_state(model.state_dict()), peft_config(cfg, base))
    w.commit(adapter=store.adapter_of(0))


def merged(model) -> dict[str, torch.Tensor]:
    """What peft itself makes of the adapted model: each layer merged, in HF names."""
    import copy

    m = copy.deepcopy(model)
    for layer in lora_layers(m):
        layer.merge()
    return {n.replace(".base_layer", ""): t for n, t in m.state_dict().items() if "lora_" not in n}


V1 = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
V2 = LoraConfig(rank=8, alpha=16.0, target_modules=["q_proj"])


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_dir):
    """A run store with v0 (the tiny model) and adapters v1, v2 of it."""
    root = tmp_path_factory.mktemp("adapters")
    store = RunStore(StorageConfig(root=str(root)), "lora")
    publish_dir(store, 0, tiny_dir)
    models = {1: trained_adapter(tiny_dir, V1, 1), 2: trained_adapter(tiny_dir, V2, 2)}
    publish_adapter(store, 1, models[1], V1, str(tiny_dir))
    publish_adapter(store, 2, models[2], V2, str(tiny_dir))
    return root, store, models


@pytest.fixture(scope="module")
def engine(run):
    _, store, _ = run
    return EmbeddedEngine(store.local_version_dir(0), 0, EngineConfig(), weight_version=0)


@pytest.fixture(scope="module")
def client(run, engine):
    root, _, _ = run
    thread = serve_in_thread(engine, ServerSettings(allowed_roots=(str(root),)))
    with EngineClient(thread.url, timeout_s=60, retries=0) as c:
        yield c
    thread.stop()


def served_state(engine) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in engine.served.model.state_dict().items()}


def test_adapters_are_served_merged_as_their_version_and_never_drift(run, engine, client):
    _, store, models = run
    base = served_state(engine)
    reply = client.load_lora_adapter("v1", store.local_version_dir(1))
    assert reply["success"], reply
    assert client.get_weight_version() == "1"
    assert client.models()[1:] == ["v1"]
    state, want = served_state(engine), merged(models[1])
    changed = {n for n in base if not torch.equal(state[n], base[n])}
    assert changed and all(n.rsplit(".", 2)[-2] in V1.target_modules for n in changed)
    assert all(torch.allclose(state[n], want[n], atol=1e-6) for n in want)
    # an engine restarted on v1 serves what the trainer would: its greedy tokens
    tokens = client.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="v1")["output_ids"]
    # a request for another adapter is refused: this engine holds one, merged in
    with pytest.raises(EngineHTTPError, match="samples from adapter 'v2'.*serves v1"):
        client.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="v2")
    # v2 adapts only q_proj: v1's v_proj and down_proj go back to the base
    assert client.load_lora_adapter("v2", store.local_version_dir(2))["success"]
    assert client.get_weight_version() == "2"
    state, want = served_state(engine), merged(models[2])
    assert all(torch.allclose(state[n], want[n], atol=1e-6) for n in want)
    assert all(torch.equal(state[n], base[n]) for n in base if "q_proj" not in n)
    assert client.unload_lora_adapter("v2")["success"]
    assert client.get_weight_version() == "0"
    assert all(torch.equal(t, base[n]) for n, t in served_state(engine).items())
    assert client.load_lora_adapter("v1", store.local_version_dir(1))["success"]
    assert client.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == tokens


def _refused(client, path, match: str) -> None:
    before = client.get_weight_version()
    with pytest.raises(EngineHTTPError, match=match) as e:
        client.load_lora_adapter("v7", str(path))
    assert e.value.status == 400
    assert client.get_weight_version() == before  # the old weights keep serving


def test_a_flipped_byte_in_an_adapter_is_refused_and_named(run, client, tmp_path):
    root, store, _ = run
    bad = root / "flipped"
    shutil.copytree(store.local_version_dir(1), bad)
    data = bytearray((bad / ADAPTER_WEIGHTS).read_bytes())
    data[len(data) // 2] ^= 0x01
    (bad / ADAPTER_WEIGHTS).write_bytes(bytes(data))
    _refused(client, bad, r"hash mismatch in adapter_model\.safetensors")


def test_an_adapter_of_another_base_and_a_full_version_are_refused(run, tiny_v1, client):
    root, store, _ = run
    other = RunStore(StorageConfig(root=str(root)), "other")
    publish_dir(other, 0, tiny_v1)  # another v0: the engine's base is not its base
    engine = EmbeddedEngine(other.local_version_dir(0), 1, EngineConfig())
    reply = engine.load_lora_adapter("v1", store.local_version_dir(1))
    theirs, ours = store.read_manifest(0).digest(), other.read_manifest(0).digest()
    assert not reply["success"]
    assert theirs[:12] in reply["message"] and ours[:12] in reply["message"]
    assert engine.get_weight_version() == "0"
    _refused(client, store.local_version_dir(0), "full weights, not an adapter")
    with pytest.raises(EngineHTTPError, match="load it with load_lora_adapter"):
        client.update_weights_from_disk(store.local_version_dir(1), weight_version="1")


def test_an_adapter_pushed_as_one_bucket_serves_the_same_bytes_as_from_disk(run, engine, tiny_dir):
    _, store, models = run
    assert engine.load_lora_adapter("v1", store.local_version_dir(1))["success"]
    from_disk = engine.state_sha256()
    pushed = EmbeddedEngine(store.local_version_dir(0), 2, EngineConfig())
    tensors = adapter_state(models[1].state_dict())
    segment = ShmSegment(flatten(tensors.items()))
    config = peft_config(V1, str(tiny_dir))
    try:
        # bytes that changed on the way (their sha256 is not the sender's): refused
        wrong = {**checksums(tensors), next(iter(tensors)): "0" * 64}
        reply = pushed.load_lora_adapter_from_tensors(
            "v1", config, [segment.handle], expected_checksums=wrong
        )
        assert not reply["success"] and "expected sha256" in reply["message"]
        assert pushed.get_weight_version() == "0"
        reply = pushed.load_lora_adapter_from_tensors(
            "v1", config, [segment.handle], expected_checksums=checksums(tensors)
        )
    finally:
        segment.close()
    assert reply["success"], reply
    assert pushed.get_weight_version() == "1"
    assert pushed.state_sha256() == from_disk
