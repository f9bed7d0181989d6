"""A tiny llama GGUF written with ``gguf.GGUFWriter`` (2 layers, hidden 64, Q4_1 matrices like
SmolLM2's GGUF) with a byte-level BPE tokenizer stored as ``tokenizer.ggml.*`` metadata (model
``gpt2``, as llama.cpp writes SmolLM2's) and a ChatML chat template; special-token ids mirror
SmolLM2's (``<|endoftext|>`` 0 = unk, ``<|im_start|>`` 1 = bos, ``<|im_end|>`` 2 = eos and pad).
Shared by the model-source, fetch-model and stored-file tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


CORPUS = [
    "What is the capital of France? Paris is the capital of France.",
    "The quick brown fox jumps over the lazy dog; numbers 0 1 2 3 4 5 6 7 8 9.",
    "system user assistant: you are a helpful model.",
]


def _bpe_tokens_and_merges() -> tuple[list[str], list[str]]:
    """A byte-level BPE (about 320 tokens) trained on CORPUS: tokens by id, merges 'a b'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    state = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(state["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    assert tokens[: len(SPECIAL)] == SPECIAL
    return tokens, merges


def write_tiny_gguf(path: Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """Write a tiny llama GGUF (Q4_1 matrices, F32 embeddings and norms) to ``path``."""
    import gguf

    heads, kv_heads, ffn, head_dim = 4, 2, 128, hidden // 4
    tokens, merges = _bpe_tokens_and_merges()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL else 1 for t in tokens])  # 3: control token
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, scale: float = 0.3) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def q4_1(name: str, arr: np.ndarray) -> None:
        qtype = gguf.GGMLQuantizationType.Q4_1
        w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

    w.add_tensor("token_embd.weight", mat(len(tokens), hidden, 1.0))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        q4_1(f"blk.{i}.attn_q.weight", mat(hidden, hidden))
        q4_1(f"blk.{i}.attn_k.weight", mat(kv_heads * head_dim, hidden))
        q4_1(f"blk.{i}.attn_v.weight", mat(kv_heads * head_dim, hidden))
        q4_1(f"blk.{i}.attn_output.weight", mat(hidden, hidden))
        q4_1(f"blk.{i}.ffn_gate.weight", mat(ffn, hidden))
        q4_1(f"blk.{i}.ffn_up.weight", mat(ffn, hidden))
        q4_1(f"blk.{i}.ffn_down.weight", mat(hidden, ffn))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", mat(len(tokens), hidden, 0.5))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
