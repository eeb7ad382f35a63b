"""The peers bench scores a peer's model as the project scores its own: the greedy
answers that transformers' generate gives (left-padded batches, cut at the first
end-of-sequence token) are the embedded engine's, token for token, and go through the
same rollout procedure, so the same prompts, decoding and rewards."""

import json

from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.peers.task import GreedyGenerate, greedy_evaluation, load_task
from engines.config import EngineConfig
from engines.embedded.engine import EmbeddedEngine
from rollout.procedure import generate_batch


def test_greedy_answers_match_the_embedded_engine(tiny_model_dir, tmp_path):
    # prompts of 2 to 13 characters: every batch of 5 is left-padded
    rows = [
        {"prompt": f"{i * 7919:013d}"[-(i % 12 + 1) :] + ":", "label": str(i)} for i in range(24)
    ]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [f"model.path={tiny_model_dir}", f"rollout.task={data}", "eval.size=24"]
    sets.append("rollout.max_new_tokens=8")
    task = load_task("configs/tiny-cpu.yaml", sets, iterations=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    engine = EmbeddedEngine(tiny_model_dir, 0, EngineConfig(), weight_version=0)

    def engine_groups(prompts, n, sampling, seeds, restart_fn=None):
        params = [{**sampling, "sampling_seed": s[0]} for s in seeds]
        return [[out] for out in engine.generate(prompts, params)]

    greedy = task.rollout.model_copy(update={"temperature": 0.0, "n_samples_per_prompt": 1})
    prompts = task.eval_prompts()
    assert len({len(p.text) for p in prompts}) > 1  # batches that need padding

    def answers(groups):
        out = generate_batch(greedy, task.seed, 0, 0, tokenizer, groups, None, prompts=prompts)
        return [(s.response_ids, s.response_text, s.reward) for s in out.batch.samples]

    ours = answers(GreedyGenerate(model, tokenizer, version=0, batch=5))
    assert ours == answers(engine_groups)

    result = greedy_evaluation(task, model, tokenizer, k=0, batch=7)
    passed = sum(r >= task.eval.pass_threshold for _, _, r in ours)
    assert result["prompts"] == 24 and result["pass_at_1_greedy"] == passed / 24
