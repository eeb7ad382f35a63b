"""HF export without Ray: tied embeddings are dropped and re-tied on load."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from storage.config import StorageConfig
from storage.run_store import RunStore
from training.export import drop_tied, write_hf_weights
from training.tiny_model import build_tokenizer, tiny_llama_config


def test_tied_export_loads_with_same_logits(tmp_path):
    base = tmp_path / "base"
    cfg = tiny_llama_config(len(build_tokenizer()))
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(base)
    build_tokenizer().save_pretrained(base)

    state = drop_tied(model, model.state_dict())
    assert "lm_head.weight" not in state and "model.embed_tokens.weight" in state
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "tied")
    writer = store.weights_writer(1, 1, 0)
    written = write_hf_weights(writer, state, shard_size=32 * 1024, base_model_path=str(base))
    writer.commit()
    assert written["shards"] > 1 and "tokenizer.json" in written["files"]
    assert not any(f.endswith(".bin") for f in written["files"])

    loaded = AutoModelForCausalLM.from_pretrained(store.local_version_dir(1)).eval()
    x = torch.tensor([[1, 5, 9, 12, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, model(input_ids=x).logits)
