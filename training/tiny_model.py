"""The tiny default model: a small Llama built from a config in code, with a
character-level tokenizer built offline by the ``tokenizers`` library.

Both are saved as a normal HF directory, so every other part of prefect-rl
treats it exactly like any local HF checkpoint. Nothing is downloaded. A
warm-started variant (``model.warm_start``) is trained a few hundred supervised
steps on demonstrations built offline before it is saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# Characters of the builtin tasks: digits, a few letters and the separators.
CHARS = list("0123456789") + list("abcdefgh") + list(" :=+-,.?")


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # One token per character; decoding concatenates them back without spaces.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )


def tiny_llama_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )


# (role, text, trained) segments of one demonstration; rollout.tools.Segment.
Demonstration = Sequence[tuple[str, str, bool]]
WARM_START_BATCH = 64
WARM_START_LR = 3e-3


def write_tiny_model(
    out_dir: str | Path, seed: int = 0, demonstrations: Sequence[Demonstration] = ()
) -> Path:
    """Write the tiny model and tokenizer to ``out_dir`` as an HF directory,
    warm-started on ``demonstrations`` when there are any."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer)))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if demonstrations:
        warm_start(model, tokenizer, demonstrations)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def encode_demonstration(
    tokenizer: PreTrainedTokenizerFast, demo: Demonstration
) -> tuple[list[int], list[int]]:
    """A demonstration's ids (bos first, eos after each model turn) and its loss mask."""
    ids, mask = [tokenizer.bos_token_id], [0]
    for role, text, trained in demo:
        seg = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if role == "model":
            seg.append(tokenizer.eos_token_id)
        ids += seg
        mask += [int(trained and role == "model")] * len(seg)
    return ids, mask


def warm_start(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    demonstrations: Sequence[Demonstration],
) -> float:
    """Supervised steps (AdamW, WARM_START_BATCH demonstrations each, in order) on
    the trained tokens' next-token loss; returns the last step's loss."""
    threads = torch.get_num_threads()
    # One thread: the same base on any machine (a reduction's order follows the
    # thread count), and a model this small gains nothing from more on a busy host.
    torch.set_num_threads(1)
    try:
        return _warm_start(model, tokenizer, demonstrations)
    finally:
        torch.set_num_threads(threads)


def _warm_start(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    demonstrations: Sequence[Demonstration],
) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=WARM_START_LR, weight_decay=0.0, foreach=False)
    model.train()
    loss = torch.zeros(())
    for start in range(0, len(demonstrations), WARM_START_BATCH):
        rows = [
            encode_demonstration(tokenizer, d)
            for d in demonstrations[start : start + WARM_START_BATCH]
        ]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        mask = torch.zeros((len(rows), width), dtype=torch.float32)
        for r, (row_ids, row_mask) in enumerate(rows):
            ids[r, : len(row_ids)] = torch.tensor(row_ids)
            attn[r, : len(row_ids)] = 1
            mask[r, : len(row_mask)] = torch.tensor(row_mask, dtype=torch.float32)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        loss = -(lp * mask[:, 1:]).sum() / mask[:, 1:].sum().clamp(min=1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())
