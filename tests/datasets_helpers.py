"""Shared helpers for the dataset tests: two different tokenizers with chat templates, built
locally with the `tokenizers` library (independent of kvdiverge.models), and small configs."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvdiverge.datasets import DatasetsConfig
from kvdiverge.datasets.ruler import wonderwords_lists

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "data" / "fixtures"

_CHAT_A = (
    "<s>{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</turn>\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
_CHAT_B = (
    "{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|stop|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def corpus() -> list[str]:
    """The lines a test tokenizer is trained on: the fixture essays, word lists, a needle."""
    lines = []
    for f in sorted((FIXTURES / "essays").glob("*.txt")):
        lines += f.read_text().splitlines()
    lists = wonderwords_lists()
    lines += [" ".join(lists["nouns"][i : i + 50]) for i in range(0, 3000, 50)]
    lines += ["The special magic number for the key is: 1234567. VAR ABCDE = VAR FGHIJ"]
    return [line for line in lines if line.strip()]


@cache
def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (vocab 700) trained on the fixture essays, chat template A."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<s>", "</turn>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</turn>", chat_template=_CHAT_A
    )


@cache
def word_tokenizer() -> PreTrainedTokenizerFast:
    """Lower-cased WordLevel over whitespace/punctuation pieces, unknown words as [UNK] (one
    token per word or punctuation mark), chat template B."""
    vocab = {"[UNK]": 0, "<|start|>": 1, "<|stop|>": 2}
    for line in corpus():
        for w in re.findall(r"\w+|[^\w\s]", line.lower()):
            vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|start|>", "<|stop|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|stop|>", unk_token="[UNK]", chat_template=_CHAT_B
    )


def length_fn(tokenizer: PreTrainedTokenizerFast):
    """Chat-wrapped length of a user message (what n means)."""

    def n(prompt: str) -> int:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return n


def section(**overrides) -> dict:
    """A `datasets:` config mapping over the fixtures (one stratum per env by default)."""
    base = {
        "seed": 11,
        "length_tokenizer": "test",
        "generation_reserve": 32,
        "cohorts": {"dev": 2, "study1": 3, "study2": 3},
        "strata": [
            {"env": "ruler", "label": "1k", "target_tokens": 1100},
            {
                "env": "helmet",
                "label": "1k",
                "target_tokens": 1100,
                "rag_passages": 4,
                "cite_documents": 3,
            },
        ],
        "ruler": {
            "essay_dir": str(FIXTURES / "essays"),
            "squad": str(FIXTURES / "squad" / "dev-v2.0.json"),
            "hotpotqa": str(FIXTURES / "hotpotqa" / "hotpot_dev_distractor_v1.json"),
        },
        "helmet": {
            "data_dir": str(FIXTURES / "helmet" / "data"),
            "prompts_dir": str(FIXTURES / "helmet" / "prompts"),
        },
    }
    base.update(overrides)
    return base


def config(**overrides) -> DatasetsConfig:
    """:class:`DatasetsConfig` of :func:`section`."""
    return DatasetsConfig.from_config(section(**overrides))
