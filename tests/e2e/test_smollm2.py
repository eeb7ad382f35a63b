"""A real pretrained model through one iteration end to end on CPU: SmolLM2-135M-
Instruct (imported from its package), a chat-template prompt, generation that stops
at <|im_end|>, the math reward, train, publish, reload, verify; then a rerun that
resumes and adds an iteration. Skips where the model has not been imported: CI
never downloads it."""

import pytest

from flows.config import load_config
from flows.driver import run_plain
from rollout.types import RolloutBatch
from training.model_import import MANIFEST
from training.model_packages import default_dir

SMOLLM2 = default_dir("smollm2-135m-instruct")


@pytest.mark.slow
@pytest.mark.skipif(
    not (SMOLLM2 / MANIFEST).is_file(),
    reason="SmolLM2 not imported; get it once (93 MB) with: "
    "prefect-rl import-model smollm2-135m-instruct",
)
def test_smollm2_iteration_end_to_end_and_resume(ray_cluster, tmp_path):
    sets = {
        "storage.root": str(tmp_path),
        "run.name": "smollm2",
        "run.iterations": 1,
        "rollout.batch_size": 4,
        "rollout.n_samples_per_prompt": 2,
        "rollout.max_new_tokens": 16,
        "eval.interval": 0,
    }
    ctx, rows, _ = run_plain(load_config("configs/smollm2-cpu.yaml", sets), quiet=True)
    assert [r["iteration"] for r in rows] == [1]
    batch = RolloutBatch.from_json(ctx.store.read_rollouts(1))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    prompt = tok.decode(batch.samples[0].prompt_ids)
    assert prompt.endswith("Answer with just the number.<|im_end|>\n<|im_start|>assistant\n")
    for s in batch.samples:  # a finished answer ends at <|im_end|>, the tokenizer's eos
        assert (s.finish_reason == "stop") == (s.response_ids[-1] == 2)
        assert 0.0 <= s.reward <= 1.0
    assert ctx.store.serving_versions() == {0: 1}
    # A rerun with one more iteration resumes from the committed first.
    ctx, rows, _ = run_plain(
        load_config("configs/smollm2-cpu.yaml", {**sets, "run.iterations": 2}), quiet=True
    )
    assert [r["iteration"] for r in rows] == [2]
    assert ctx.store.serving_versions() == {0: 2}
