"""Demo models and the loading path every model takes (kvdiverge.models)."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
import transformers

from kvdiverge.models import (
    build_demo_model,
    chat_prompt_ids,
    eos_token_ids,
    load_model,
    load_tokenizer,
    resolve_dtype,
)

transformers.utils.logging.disable_progress_bar()


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def demo_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    return {kind: build_demo_model(kind, root / kind, seed=7) for kind in ("llama", "qwen2")}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_build_is_deterministic_in_seed(kind, demo_dirs, tmp_path):
    again = build_demo_model(kind, tmp_path / "again", seed=7)
    other = build_demo_model(kind, tmp_path / "other", seed=8)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _digest(again / name) == _digest(demo_dirs[kind] / name)
    assert _digest(other / "model.safetensors") != _digest(again / "model.safetensors")
    assert (demo_dirs[kind] / "model.safetensors").stat().st_size < 4_000_000


def test_architectures_and_tokenizers_differ(demo_dirs):
    llama = load_model(str(demo_dirs["llama"]))
    qwen = load_model(str(demo_dirs["qwen2"]))
    assert llama.config.model_type == "llama" and qwen.config.model_type == "qwen2"
    assert llama.config.num_key_value_heads < llama.config.num_attention_heads  # GQA
    bias = qwen.model.layers[0].self_attn.k_proj.bias
    assert bias is not None and bias.abs().min() > 0
    assert llama.model.layers[0].self_attn.k_proj.bias is None
    tl, tq = load_tokenizer(str(demo_dirs["llama"])), load_tokenizer(str(demo_dirs["qwen2"]))
    assert len(tl) != len(tq)
    assert llama.dtype == torch.float32  # CPU → fp32


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tokenizer_round_trips_any_text(kind, demo_dirs):
    tok = load_tokenizer(str(demo_dirs[kind]))
    text = "Zyxwvut 0xDEADBEEF — Ünïcödé 漢字 🙂\ttabs\nnewlines  double  spaces"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_chat_prompt_wraps_user_message_with_generation_prompt(kind, demo_dirs):
    tok = load_tokenizer(str(demo_dirs[kind]))
    model = load_model(str(demo_dirs[kind]))
    message = "What is the special magic number?"
    ids = chat_prompt_ids(tok, message)
    text = tok.decode(ids)
    assert message in text
    body = tok(message, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(body)
    assistant = "<|assistant|>\n" if kind == "llama" else "<|im_start|>assistant\n"
    assert text.endswith(assistant)
    eos = eos_token_ids(model, tok)
    assert eos[0] == tok.eos_token_id
    assert tok.convert_ids_to_tokens(eos[0]) in ("<|end|>", "<|im_end|>")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_next_token_laws_far_from_uniform(kind, demo_dirs):
    tok = load_tokenizer(str(demo_dirs[kind]))
    model = load_model(str(demo_dirs[kind]))
    ids = torch.tensor([chat_prompt_ids(tok, "The river flows north through the valley.")])
    with torch.no_grad():
        probs = model(ids).logits[0].double().softmax(-1)
    entropy = -(probs * probs.clamp_min(1e-300).log()).sum(-1)
    assert entropy.mean() < 0.6 * math.log(probs.shape[-1])


def test_dtype_and_device_resolution():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float16", torch.device("cpu"))
    with pytest.raises(ValueError, match="demo"):
        build_demo_model("gpt2", "/nonexistent", seed=0)
