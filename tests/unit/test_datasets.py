"""Dataset files (JSONL, Parquet) with named keys, errors that name the file,
row and key, and the chat template applied to prompts (real HF tokenizer)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout.config import RolloutConfig
from rollout.datasets import DatasetError, PromptSource, encode_observation, encode_prompt
from rollout.procedure import generate_batch
from training.tiny_model import build_tokenizer

# One user turn between <bos> and "=", then the generation prompt ":".
TEMPLATE = (
    "{% for m in messages %}<bos>{{ m['content'] }}={% endfor %}"
    "{% if add_generation_prompt %}:{% endif %}"
)


def _parquet(path, columns: dict) -> str:
    pq.write_table(pa.table(columns), path)
    return str(path)


def test_parquet_dataset_reads_named_columns(tmp_path):
    path = _parquet(
        tmp_path / "d.parquet",
        {"question": ["1+1=", "2+2=", "3+3="], "answer": [2, 4, 6], "other": [0.1, 0.2, 0.3]},
    )
    cfg = RolloutConfig(task=path, input_key="question", label_key="answer", batch_size=3)
    src = PromptSource(cfg, seed=0)
    assert sorted((p.text, p.label) for p in src.batch(1)) == [
        ("1+1=", "2"),
        ("2+2=", "4"),
        ("3+3=", "6"),
    ]
    assert src.batch(2) == PromptSource(cfg, seed=0).batch(2)  # a function of (seed, k)


@pytest.mark.parametrize(
    "columns, key, message",
    [
        ({"q": ["a"], "b": ["1"]}, "a", r"d.parquet: no column 'a'; it has \['q', 'b'\]"),
        ({"q": ["a", None], "a": ["1", "2"]}, "a", r"d.parquet: row 2: key 'q' is null"),
        ({"q": [[1], [2]], "a": ["1", "2"]}, "a", r"d.parquet: row 1: key 'q' is a list"),
    ],
    ids=["missing-column", "null", "not-text"],
)
def test_bad_parquet_names_file_row_and_key(tmp_path, columns, key, message):
    path = _parquet(tmp_path / "d.parquet", columns)
    with pytest.raises(DatasetError, match=message):
        PromptSource(RolloutConfig(task=path, input_key="q", label_key=key), seed=0)


@pytest.mark.parametrize(
    "rows, message",
    [
        ('{"q": "1", "a": "1"}\n{"q": "2"}\n', r"d.jsonl:2: missing key 'a'"),
        ('{"q": "1", "a": "1"}\n\n{"q": null, "a": "2"}\n', r"d.jsonl:3: key 'q' is null"),
        ('{"q": "1", "a": {"x": 1}}\n', r"d.jsonl:1: key 'a' is a dict, expected a string or"),
    ],
    ids=["missing", "null-after-blank-line", "label-object"],
)
def test_bad_jsonl_rows_name_the_line(tmp_path, rows, message):
    path = tmp_path / "d.jsonl"
    path.write_text(rows)
    with pytest.raises(DatasetError, match=message):
        PromptSource(RolloutConfig(task=str(path), input_key="q", label_key="a"), seed=0)


def test_unknown_suffix_is_refused_with_the_formats(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("q,a\n1,1\n")
    with pytest.raises(DatasetError, match=r"unknown dataset format '.csv'; give a .jsonl"):
        PromptSource(RolloutConfig(task=str(path)), seed=0)


def test_chat_template_wraps_the_prompt_as_a_user_turn():
    tok = build_tokenizer()
    plain = encode_prompt(tok, "12", chat_template=False)
    assert plain == tok("12")["input_ids"]  # bos + the two characters
    tok.chat_template = TEMPLATE
    ids = encode_prompt(tok, "12", chat_template=True)
    # one <bos> from the template (none added on top), then "12=" and ":"
    assert ids == [tok.bos_token_id] + tok("12=:", add_special_tokens=False)["input_ids"]


def test_chat_template_on_without_one_names_the_fix():
    with pytest.raises(DatasetError, match="has no chat template; set rollout.chat_template"):
        encode_prompt(build_tokenizer(), "12", chat_template=True)


def test_rollout_sends_templated_prompts_to_the_engines():
    """rollout.chat_template reaches the rollout procedure: the engines get the
    templated ids, and the sample records them as its prompt."""
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    sent = []

    def generate_groups(prompts, n, sampling, seeds, restart_fn=None):
        sent.extend(prompts)
        meta = {"weight_version": "0", "finish_reason": {"type": "stop"}}
        return [[{"output_ids": [2], "meta_info": {**meta, "output_token_logprobs": [[-1.0]]}}]]

    cfg = RolloutConfig(batch_size=1, n_samples_per_prompt=1, chat_template=True)
    out = generate_batch(cfg, 0, 1, 0, tok, generate_groups, restart=lambda i: None)
    text = PromptSource(cfg, seed=0).batch(1)[0].text
    assert sent == [encode_prompt(tok, text, chat_template=True)]
    assert out.batch.samples[0].prompt_ids == sent[0]
    assert tok.decode(sent[0], skip_special_tokens=True) == f"{text}=:"


def test_json_lines_and_parquet_give_the_same_prompts(tmp_path):
    rows = [{"p": f"{i}+0=", "l": str(i)} for i in range(5)]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows))
    pqt = _parquet(
        tmp_path / "d.parquet", {"p": [r["p"] for r in rows], "l": [r["l"] for r in rows]}
    )

    def batch(task):
        return PromptSource(RolloutConfig(task=task, input_key="p", label_key="l", batch_size=4), 3)

    assert batch(str(jl)).batch(2) == batch(pqt).batch(2)


def test_dotted_keys_reach_nested_fields_in_both_formats(tmp_path):
    """verl-style rows: the label inside a struct (Parquet) or an object (JSONL)."""
    rows = [{"q": f"{i}+1=", "reward_model": {"ground_truth": str(i + 1)}} for i in range(3)]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows))
    pqt = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist(rows), pqt)
    for task in (str(jl), pqt):
        cfg = RolloutConfig(
            task=task, input_key="q", label_key="reward_model.ground_truth", batch_size=3
        )
        got = sorted((p.text, p.label) for p in PromptSource(cfg, seed=0).batch(1))
        assert got == [("0+1=", "1"), ("1+1=", "2"), ("2+1=", "3")]
    jl.write_text(json.dumps({"q": "1", "reward_model": {"style": "rule"}}))
    cfg = RolloutConfig(task=str(jl), input_key="q", label_key="reward_model.ground_truth")
    with pytest.raises(
        DatasetError,
        match=r"d.jsonl:1: missing key 'reward_model.ground_truth' \('ground_truth' not in reward_model, which has \['style'\]\)",
    ):
        PromptSource(cfg, seed=0)


# A ChatML-like template over the tiny vocabulary: <bos> opens a turn (role letter,
# then ':'), <eos> closes it, and '=' separates turns as ChatML's newline does.
TURNS = (
    "{% for m in messages %}<bos>{{ m['role'][0] }}:{{ m['content'] }}<eos>={% endfor %}"
    "{% if add_generation_prompt %}<bos>a:{% endif %}"
)


def test_an_observation_in_a_chat_episode_is_the_next_user_turn():
    """Multi-turn with rollout.chat_template: after a model turn that stopped at the
    template's end token, the environment's text arrives as the template's next user
    turn and ends in the generation prompt: the context equals the template's own
    rendering of the whole conversation. A turn cut short is closed first."""
    tok = build_tokenizer()
    tok.chat_template = TURNS
    prompt = encode_prompt(tok, "12", chat_template=True)
    model = tok("?1+2", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    obs = encode_observation(tok, ":3.", chat_template=True, ended=True)
    whole = tok.apply_chat_template(
        [
            {"role": "user", "content": "12"},
            {"role": "assistant", "content": "?1+2"},
            {"role": "user", "content": ":3."},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt + model + obs == tok(whole, add_special_tokens=False)["input_ids"]
    cut = encode_observation(tok, ":3.", chat_template=True, ended=False)
    assert cut == [tok.eos_token_id, *obs]
    # Without the template the text goes in as it is (the calculator's ':3.').
    plain = encode_observation(tok, ":3.", chat_template=False, ended=True)
    assert plain == tok(":3.", add_special_tokens=False)["input_ids"]


def test_a_template_that_does_not_close_turns_with_eos_is_refused_for_episodes():
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE  # no <eos> between turns
    with pytest.raises(DatasetError, match="does not end a turn with its eos"):
        encode_observation(tok, ":3.", chat_template=True, ended=True)
