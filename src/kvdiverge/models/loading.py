"""Models and tokenizers: loading any causal LM, chat prompts, EOS ids and tiny demo models.

The models are chat models with their chat template applied (`docs/method.md`, "The
language-model study"): the tokenized prompt length n (which fixes every budget) is the length of
the user message wrapped by the template with the generation prompt. Real models and the two demo
models built here go through exactly the same loading path (``AutoTokenizer`` /
``AutoModelForCausalLM`` from a directory or hub id, safetensors only, remote code only when
enabled for that model).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CPU_FALLBACK_VARIABLE",
    "DEMO_KINDS",
    "DeviceError",
    "build_demo_model",
    "chat_prompt_ids",
    "cuda_unavailable_reason",
    "demo_spec_digest",
    "demo_tokenizer_and_config",
    "eos_token_ids",
    "load_model",
    "load_tokenizer",
    "resolve_device",
    "resolve_dtype",
    "save_model_dir",
]

DemoKind = Literal["llama", "qwen2"]

# A small built-in English corpus for the demo tokenizers (byte-level BPE: any text still
# tokenizes, unknown words fall back to bytes). Written for this project.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A needle is hidden in a haystack of text, and the
model must find the special magic number that belongs to the key. What is the special magic
number for the city mentioned in the passage? Answer the question using only the documents.
Read the following context carefully and answer the question at the end in a few words.
Document 1: The river flows north through the valley, past the old mill and the stone bridge.
Document 2: In the year the library opened, the town council voted to build a new school.
Document 3: The committee met on Tuesday to discuss the budget, the schedule and the report.
One of the special magic numbers for the word apple is 482913. Remember it; you will be asked.
The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.
Variables: X1 = 12345, X2 = X1, X3 = X2. Find all variables that are assigned the value 12345.
Question: who wrote the letter that was found in the attic of the house on the hill?
Answer: the letter was written by the grandmother of the family who lived there in winter.
Summarize the passage in one sentence. List the three most common words in the text below.
Numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024 2025 2026; punctuation , . ; : ! ? ( ) " '.
She said that they would arrive in the morning, but the train was late and it rained all day.
Large language models read a prompt, store keys and values in a cache, and generate tokens one
at a time; evicting entries from the cache changes what the model attends to afterwards.
"""

_SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
_CHATML_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Demo architectures: tiny, deterministic, with next-token laws far from uniform
# (initializer_range well above HF's default 0.02). Llama: grouped-query attention, no biases.
# Qwen2: q/k/v biases (set to non-zero values), a different tokenizer and chat template.
_DEMO_SPECS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 512,
        "special": _SPECIAL_TOKENS,
        "eos": "<|end|>",
        "bos": "<|endoftext|>",
        "template": _LLAMA_TEMPLATE,
        "config": {
            "hidden_size": 64,
            "intermediate_size": 192,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 32768,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        },
    },
    "qwen2": {
        "vocab_size": 640,
        "special": _CHATML_SPECIAL,
        "eos": "<|im_end|>",
        "bos": None,
        "template": _CHATML_TEMPLATE,
        "config": {
            "hidden_size": 96,
            "intermediate_size": 256,
            "num_hidden_layers": 3,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
        },
    },
}
DEMO_KINDS: tuple[str, ...] = tuple(_DEMO_SPECS)


CPU_FALLBACK_VARIABLE = "KVDIVERGE_CPU_FALLBACK"
"""Set to ``1``, ``device: auto`` runs on the CPU even on a job that was given a GPU."""


class DeviceError(ValueError):
    """The requested device cannot be used here (one line, before any model work)."""


def cuda_unavailable_reason(environ: Mapping[str, str] | None = None) -> str:
    """Why torch finds no CUDA device, in words: a CPU-only build, every GPU hidden by
    ``CUDA_VISIBLE_DEVICES``, or a CUDA build that sees no device (driver or node)."""
    from kvdiverge.pipeline.hardware import gpus_hidden

    env = os.environ if environ is None else environ
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if gpus_hidden(env):
        return f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r} hides every GPU"
    return (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable CUDA device; "
        "check the node's driver with nvidia-smi"
    )


def resolve_device(device: str = "auto", environ: Mapping[str, str] | None = None) -> torch.device:
    """The torch device of ``device`` (``auto``, ``cpu``, ``cuda`` or ``cuda:<i>``), or one-line
    :class:`DeviceError` (`docs/running.md`, "The device").

    ``auto`` is CUDA when torch finds it, else the CPU, but only where nothing promised this job
    a GPU (:func:`kvdiverge.pipeline.hardware.gpu_requested`: SLURM allocated it one, or the
    machine is a GPU host): there a missing CUDA is an error, not hours on the CPU, unless
    :data:`CPU_FALLBACK_VARIABLE` is ``1`` (a node whose GPU is a stand-in, as the cluster
    test's). ``cuda`` without CUDA, or ``cuda:<i>`` beyond the visible devices, is an error
    naming why."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        from kvdiverge.pipeline.hardware import gpu_requested

        env = os.environ if environ is None else environ
        promised = gpu_requested(env)
        if promised is not None and env.get(CPU_FALLBACK_VARIABLE) != "1":
            raise DeviceError(
                f"device: auto, but {promised} and CUDA is not available here "
                f"({cuda_unavailable_reason(environ)}): refusing to run on the CPU; set "
                "rollout.device: cpu (kvdiverge compare: --device cpu) to run there"
            )
        return torch.device("cpu")
    if device != "cpu" and device != "cuda" and not re.fullmatch(r"cuda:\d+", device):
        raise DeviceError(f"device: expected auto, cpu, cuda or cuda:<index>, got {device!r}")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceError(
                f"device: {device!r} requested but CUDA is not available here "
                f"({cuda_unavailable_reason(environ)})"
            )
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise DeviceError(
                f"device: {device!r} requested but only {torch.cuda.device_count()} CUDA "
                "device(s) are visible"
            )
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` → bf16 on CUDA, fp32 on CPU; ``float32``/``bfloat16`` as given."""
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in table:
        raise ValueError(f"dtype: expected auto, float32 or bfloat16, got {dtype!r}")
    return table[dtype]


def load_tokenizer(
    path_or_id: str, trust_remote_code: bool = False, revision: str | None = None
) -> PreTrainedTokenizerBase:
    """The tokenizer of a local model directory or hub id; honours ``HF_HUB_OFFLINE``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        str(path_or_id), trust_remote_code=trust_remote_code, revision=revision
    )
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{path_or_id}: tokenizer has no chat template (prompts are chat-wrapped)")
    from kvdiverge.models.checks import check_tokenizer

    check_tokenizer(tok, path_or_id)  # template, ids and EOS against the folder: one line each
    return tok


def chat_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as the user message of the chat template, with generation prompt.

    The tokenized prompt length n is ``len(chat_prompt_ids(tokenizer, prompt))``. The
    template is rendered to text and encoded without adding special tokens again (the template
    itself writes BOS where the model wants it), as ``apply_chat_template`` does.
    """
    from kvdiverge.models.checks import render_chat

    text = render_chat(tokenizer, prompt, str(getattr(tokenizer, "name_or_path", "tokenizer")))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids]


def load_model(
    path_or_id: str,
    device: str = "auto",
    dtype: str = "auto",
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load a causal LM for rollouts: eval mode, safetensors weights only.

    ``device``: auto|cpu|cuda (auto → CUDA when present); ``dtype``: auto|float32|bfloat16
    (auto → bf16 on CUDA, fp32 on CPU). Remote code runs only with ``trust_remote_code=True``.
    """
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    model = AutoModelForCausalLM.from_pretrained(
        str(path_or_id),
        revision=revision,
        trust_remote_code=trust_remote_code,
        dtype=torch_dtype,
        use_safetensors=True,
        attn_implementation="sdpa",
    )
    model.to(dev)
    model.eval()
    return model


def eos_token_ids(model: Any, tokenizer: Any | None = None) -> list[int]:
    """End-of-sequence token ids: the generation config's ``eos_token_id`` (int or list), else
    the tokenizer's EOS. The engine treats all of them as one outcome of the next-token law
    (:func:`kvdiverge.theory.coupling.merge_eos`), so their order does not matter."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    raw = getattr(gen, "eos_token_id", None) if gen is not None else None
    if raw is None:
        raw = getattr(model.config, "eos_token_id", None)
    if raw is not None:
        ids.extend([int(raw)] if isinstance(raw, int) else [int(i) for i in raw])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        if int(tokenizer.eos_token_id) not in ids:
            ids.append(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError("model: no EOS token id in the generation config or the tokenizer")
    return ids


def _train_demo_tokenizer(vocab_size: int, special: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tok


def demo_spec_digest(kind: DemoKind) -> str:
    """SHA-256 of demo architecture ``kind``'s spec: model config, tokenizer vocabulary size,
    special tokens, chat template and corpus (part of a trained model's fingerprint,
    so that editing ``load_model`` or other loading code does not mark trained weights stale)."""
    import hashlib
    import json

    if kind not in _DEMO_SPECS:
        raise ValueError(f"demo: expected one of {', '.join(DEMO_KINDS)}, got {kind!r}")
    payload = json.dumps({"spec": _DEMO_SPECS[kind], "corpus": _CORPUS}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def demo_tokenizer_and_config(kind: DemoKind, initializer_range: float = 0.02) -> tuple[Any, Any]:
    """The tokenizer and an (unweighted) model config of demo architecture ``kind``.

    The tokenizer is byte-level BPE trained deterministically on the built-in corpus, with the
    kind's chat template, EOS and pad tokens; the config is ``LlamaConfig`` (grouped-query
    attention) or ``Qwen2Config`` (q/k/v biases) with the kind's sizes and special-token ids.
    """
    from transformers import LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

    if kind not in _DEMO_SPECS:
        raise ValueError(f"demo: expected one of {', '.join(DEMO_KINDS)}, got {kind!r}")
    spec = _DEMO_SPECS[kind]
    raw = _train_demo_tokenizer(spec["vocab_size"], spec["special"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=spec["eos"],
        bos_token=spec["bos"],
        pad_token="<|endoftext|>",
        chat_template=spec["template"],
    )
    ids = {t: raw.token_to_id(t) for t in spec["special"]}
    cfg_cls = LlamaConfig if kind == "llama" else Qwen2Config
    config = cfg_cls(
        vocab_size=raw.get_vocab_size(),
        initializer_range=initializer_range,
        bos_token_id=ids[spec["bos"]] if spec["bos"] else None,
        eos_token_id=ids[spec["eos"]],
        pad_token_id=ids["<|endoftext|>"],
        **spec["config"],
    )
    return tokenizer, config


def save_model_dir(
    model: Any,
    tokenizer: Any,
    out_dir: str | os.PathLike,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write ``model`` (safetensors), its generation config and ``tokenizer`` into ``out_dir``,
    plus ``extra_files`` (name → text), all at once: built in a sibling temporary folder that
    then replaces ``out_dir`` (a reader never sees a half-written model)."""
    from transformers import GenerationConfig

    cfg = model.config
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id
    )
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def build_demo_model(
    kind: DemoKind,
    out_dir: str | os.PathLike,
    seed: int,
    initializer_range: float = 0.1,
    head_range: float = 0.5,
    embed_range: float = 1.0,
) -> Path:
    """Build a tiny demo model of architecture ``kind`` into ``out_dir`` (docs/models.md,
    "Demo models").

    Writes config.json, generation_config.json, model.safetensors and the tokenizer (byte-level
    BPE trained deterministically on a built-in corpus, with chat template and EOS) through
    ``save_pretrained``, so it loads back with :func:`load_model` / :func:`load_tokenizer`
    exactly like a real model. Deterministic in ``seed``. ``llama``: grouped-query attention;
    ``qwen2``: non-zero q/k/v biases and a different tokenizer and template.
    """
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    tokenizer, config = demo_tokenizer_and_config(kind, initializer_range)
    model_cls = LlamaForCausalLM if kind == "llama" else Qwen2ForCausalLM
    gen = torch.Generator().manual_seed(int(seed))
    model = model_cls(config)
    with torch.no_grad():
        # Draw every parameter from our own generator (independent of global RNG state and of
        # transformers' init order): weights N(0, r), norms 1, q/k/v biases N(0, r) for Qwen2,
        # the LM head N(0, head_range): peaked next-token laws from a well-conditioned body
        # (fp32 logits then agree with a float64 forward to ~1e-5).
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                scale = initializer_range
                if name.startswith("lm_head"):
                    scale = head_range
                elif name.endswith("embed_tokens.weight"):
                    scale = embed_range
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    model.eval()
    return save_model_dir(model, tokenizer, out_dir)
