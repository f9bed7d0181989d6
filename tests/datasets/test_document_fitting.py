"""Documents that fit every model: fitted under the longest of several tokenizers' chat-wrapped
lengths, checked under each, with one line naming the document, model and lengths otherwise.

The two tokenizers are built here with the `tokenizers` library and split digits as the paper's
two models do: one keeps up to three digits per piece (as Llama-3's pre-tokenizer), the other
splits every digit (as Qwen2's), so RULER's numeric needles cost the second more tokens.
"""

from __future__ import annotations

import re
from functools import cache

import datasets_helpers
import polars as pl
import pytest
from datasets_helpers import config
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvdiverge.datasets import (
    DatasetsConfig,
    LengthFitError,
    LongestLength,
    ModelLength,
    materialize_for_models,
    materialize_stratum,
)
from kvdiverge.datasets.fitting import check_model_windows, model_lengths

_CHAT = (
    "<|begin|>{% for m in messages %}<|head|>{{ m['role'] }}<|end_head|>{{ m['content'] }}"
    "<|eot|>{% endfor %}{% if add_generation_prompt %}<|head|>assistant<|end_head|>{% endif %}"
)
_SPECIAL = ["<|begin|>", "<|head|>", "<|end_head|>", "<|eot|>"]


def _corpus() -> list[str]:
    lines = datasets_helpers.corpus()
    lines += [f"The special magic number for key {i} is: {7919 * i % 9999991}." for i in range(400)]
    lines += [f"VAR ABC{i % 7} = {31337 * i % 99999}" for i in range(200)]
    lines += ["What are all the special magic numbers mentioned in the provided text?"] * 5
    return lines


@cache
def _tokenizer(digits: str) -> PreTrainedTokenizerFast:
    """Byte-level BPE over digit pieces of up to three (``grouped``) or of one (``single``)."""
    if digits == "grouped":
        split = pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated")
    else:
        split = pre_tokenizers.Digits(individual_digits=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|eot|>", chat_template=_CHAT
    )


def _length(tokenizer: PreTrainedTokenizerFast):
    def n(prompt: str) -> int:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return n


def _models(window_single: int | None = None) -> list[ModelLength]:
    return [
        ModelLength("grouped", _length(_tokenizer("grouped")), None),
        ModelLength("single", _length(_tokenizer("single")), window_single),
    ]


def _ruler(tasks=("niah_multikey_2",), target=900) -> DatasetsConfig:
    return config(
        length_tokenizer="grouped",
        strata=[{"env": "ruler", "label": "1k", "target_tokens": target}],
        ruler={**config_section_ruler(), "tasks": list(tasks)},
        cohorts={"dev": 1, "study1": 2, "study2": 0},
    )


def config_section_ruler() -> dict:
    from datasets_helpers import section

    return section()["ruler"]


def test_the_two_tokenizers_split_digits_differently():
    grouped, single = _tokenizer("grouped"), _tokenizer("single")
    text = "1234567"
    pieces_g = grouped.tokenize(text)
    pieces_s = single.tokenize(text)
    assert all(len(p) <= 3 for p in pieces_g) and any(len(p) > 1 for p in pieces_g)
    assert pieces_s == list(text)
    prose = "the special magic number"
    assert len(grouped.tokenize(prose)) == len(single.tokenize(prose))


def test_longest_length_is_the_maximum_of_the_models_lengths():
    ms = _models()
    longest = LongestLength(ms)
    for prompt in ["plain words only", "numbers 1234567 and 89", "VAR ABC1 = 12345 " * 30]:
        each = [m.length_fn(prompt) for m in ms]
        assert longest(prompt) == max(each)
        assert longest.lengths(prompt) == {"grouped": each[0], "single": each[1]}
    numeric = "The special magic number for key 5 is: 1234567. " * 20
    assert longest.lengths(numeric)["single"] > longest.lengths(numeric)["grouped"]
    assert longest.describe(numeric).startswith(
        f"{longest.lengths(numeric)['single']} tokens under single (grouped: "
    )


def test_ruler_documents_fit_every_tokenizer_and_record_each_length():
    """Fitted under one tokenizer the digit-heavy documents overflow the other's budget;
    fitted under both, each model's own length plus the reserve is within target_tokens, and the
    recorded lengths are each tokenizer's own (recomputed here)."""
    cfg = _ruler()
    budget = 900 - cfg.generation_reserve
    single = _length(_tokenizer("single"))
    alone = materialize_stratum(cfg, "ruler-1k", _length(_tokenizer("grouped")))
    over = [single(p) for p in alone["prompt"]]
    assert max(over) > budget, "the test needs documents that one tokenizer fits, not the other"
    frame, lengths = materialize_for_models(cfg, "ruler-1k", _models())
    assert set(lengths) == {"grouped", "single"}
    assert list(lengths["grouped"]) == frame["doc_id"].to_list()
    for name, fn in [("grouped", _length(_tokenizer("grouped"))), ("single", single)]:
        measured = [fn(p) for p in frame["prompt"]]
        assert [lengths[name][d] for d in frame["doc_id"]] == measured
        assert max(measured) + cfg.generation_reserve <= 900
    # n_tokens is the length tokenizer's; the label stays nominal
    assert frame["n_tokens"].to_list() == [lengths["grouped"][d] for d in frame["doc_id"]]
    assert set(frame["length_label"]) == {"1k"} and set(frame["target_tokens"]) == {900}
    # the binding tokenizer's documents still fill the budget (RULER's search kept its meaning)
    assert max(lengths["single"].values()) > 0.8 * budget


def test_helmet_documents_fit_every_tokenizer():
    cfg = config(
        length_tokenizer="single",
        strata=[
            {
                "env": "helmet",
                "label": "1k",
                "target_tokens": 1100,
                "rag_passages": 4,
                "cite_documents": 3,
            }
        ],
        cohorts={"dev": 2, "study1": 2, "study2": 0},
    )
    frame, lengths = materialize_for_models(cfg, "helmet-1k", _models())
    for name in ("grouped", "single"):
        assert max(lengths[name].values()) + cfg.generation_reserve <= 1100
    assert frame["n_tokens"].to_list() == [lengths["single"][d] for d in frame["doc_id"]]


def test_a_window_below_the_stratum_is_refused_before_any_document():
    cfg = _ruler()
    calls = []
    ms = [ModelLength("grouped", lambda p: calls.append(p) or 1, None)]
    ms.append(ModelLength("single", lambda p: calls.append(p) or 1, 512))
    with pytest.raises(LengthFitError) as err:
        materialize_for_models(cfg, "ruler-1k", ms)
    assert str(err.value) == (
        "ruler-1k: target_tokens 900 exceeds the context window of single (512 positions); "
        "lower target_tokens to at most 512 or leave the model out"
    )
    assert calls == []
    check_model_windows(ms, "ruler-1k", 512)  # a window equal to the stratum holds it


def test_a_document_over_one_models_budget_is_named_with_the_model_and_lengths():
    lengths = LongestLength(
        [ModelLength("a", lambda p: len(p), None), ModelLength("b", lambda p: 2 * len(p), 50)]
    )
    assert model_lengths(["s/dev/000"], ["x" * 10], lengths, 100, 8) == {"a": [10], "b": [20]}
    with pytest.raises(LengthFitError) as err:
        model_lengths(["s/dev/000", "s/dev/001"], ["x" * 10, "y" * 30], lengths, 100, 8)
    assert str(err.value) == (
        "s/dev/001: 60 tokens under b + generation_reserve 8 = 68 exceeds the context window "
        "of 50 positions (all models: a: 30, b: 60)"
    )
    with pytest.raises(LengthFitError, match=r"^s/dev/000: 30 tokens under a \+ generation"):
        model_lengths(["s/dev/000"], ["x" * 30], LongestLength([lengths.models[0]]), 36, 8)


def test_no_fit_names_the_binding_model_and_every_length():
    """A budget too small for the shortest prompt: one line naming the stratum, task, the model
    that needs the most tokens and the other model's count."""
    cfg = _ruler(tasks=("niah_multikey_2",), target=120)
    with pytest.raises(LengthFitError) as err:
        materialize_for_models(cfg, "ruler-1k", _models())
    line = str(err.value)
    assert "\n" not in line
    assert re.fullmatch(
        r"ruler-1k niah_multikey_2: the shortest prompt needs (\d+) tokens under (single|grouped) "
        r"\((single|grouped): (\d+)\), over the budget of 88 \(target_tokens 120 - "
        r"generation_reserve 32\)",
        line,
    ), line


def test_custom_prompts_over_one_models_budget_name_it(tmp_path):
    path = tmp_path / "p.jsonl"
    prompt = "4711 " * 60
    path.write_text('{"id": "q1", "prompt": "' + prompt + '", "answers": ["x"]}\n')
    grouped = _length(_tokenizer("grouped"))
    n_grouped, n_single = grouped(prompt), _length(_tokenizer("single"))(prompt)
    assert n_grouped < n_single
    cfg = config(
        length_tokenizer="grouped",
        strata=[
            {"env": "custom", "label": "c", "target_tokens": n_grouped + 32, "path": str(path)}
        ],
        cohorts={"dev": 1, "study1": 0, "study2": 0},
    )
    assert materialize_stratum(cfg, "custom-c", grouped).height == 1  # fits one tokenizer
    with pytest.raises(LengthFitError, match=r"tokens under single \(grouped: \d+\), over the"):
        materialize_for_models(cfg, "custom-c", _models())


def test_documents_table_of_one_model_is_unchanged():
    """One model: the same documents as fitting under its length function alone."""
    cfg = _ruler()
    grouped = _length(_tokenizer("grouped"))
    alone = materialize_stratum(cfg, "ruler-1k", grouped)
    frame, lengths = materialize_for_models(cfg, "ruler-1k", _models()[:1])
    assert frame.equals(alone)
    assert list(lengths) == ["grouped"]
    assert isinstance(frame, pl.DataFrame)
