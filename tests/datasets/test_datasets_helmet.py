"""HELMET RAG and Cite: the fixtures parse through the real loaders; templates, two
demonstrations, HELMET's demo choice, PopQA's filter, truncation to the budget; errors."""

from __future__ import annotations

import json
import math
import random
import re

import numpy as np
import pytest
from datasets_helpers import FIXTURES, bpe_tokenizer, config, length_fn, word_tokenizer

from kvdiverge.datasets import HELMET_DATASETS, materialize_stratum
from kvdiverge.datasets import helmet as H
from kvdiverge.datasets.fixtures import DEFAULT_KILT_PASSAGES, write_fixtures
from kvdiverge.datasets.text import is_synthetic

DATA, PROMPTS = FIXTURES / "helmet" / "data", FIXTURES / "helmet" / "prompts"


def source(dataset: str, count: int = 4) -> H.HelmetSource:
    return H.load_helmet_source(dataset, DATA, PROMPTS, count, seed=1)


@pytest.mark.parametrize("dataset", HELMET_DATASETS)
@pytest.mark.parametrize("count", DEFAULT_KILT_PASSAGES)
def test_every_fixture_file_parses_through_the_loader(dataset, count):
    src = source(dataset, count)
    assert src.source.endswith("(synthetic)")
    assert len(src.key_order) >= 4 and sorted(src.key_order) == sorted(src.groups)
    for rows in src.groups.values():
        if dataset.startswith("kilt"):
            depth = 3 if dataset == "kilt_hotpotqa" else 6
            assert len(rows) == depth  # every depth copy of the question
            assert all(len(r["ctxs"]) == count for r in rows)
            golds = [[c["has_answer"] for c in r["ctxs"]].index(True) for r in rows]
            assert len(set(golds)) > 1  # the gold passage moves between depth copies
        else:
            assert len(rows) == 1 and len(rows[0]["docs"]) >= 14


def test_fixtures_are_reproduced_byte_for_byte(tmp_path):
    written = write_fixtures(tmp_path)
    for path in written:
        committed = FIXTURES / path.relative_to(tmp_path)
        assert committed.read_bytes() == path.read_bytes(), committed
    assert is_synthetic(FIXTURES / "squad" / "dev-v2.0.json")
    assert not is_synthetic(tmp_path.parent)


def test_popqa_keeps_only_unpopular_questions():
    rows = [json.loads(line) for line in (DATA / "kilt" / "popqa_test_1000_k4_dep6.jsonl").open()]
    kept = {r["id"] for r in rows if math.log10(r["s_pop"]) < 3}
    dropped = {r["id"] for r in rows} - kept
    assert kept and dropped
    assert set(source("kilt_popqa").groups) == kept


def _hf_shuffle_then_dedup(pool, key, shots):
    h = int.from_bytes(__import__("hashlib").sha256(key.encode()).digest(), "big") % 2**31
    order = np.random.default_rng(h).permutation(len(pool))
    seen, out = set(), []
    for i in order:
        k = pool[i]["_key"]
        if k not in seen:
            seen.add(k)
            out.append(pool[i])
    return out[:shots]


@pytest.mark.parametrize("dataset", ["kilt_nq", "kilt_triviaqa", "kilt_hotpotqa", "kilt_popqa"])
def test_rag_prompt_follows_helmet_template(dataset):
    src = source(dataset)
    key = src.key_order[0]
    fn = length_fn(bpe_tokenizer())
    built = H.build_helmet_prompt(src, key, 4, random.Random(0), fn, budget=10_000)
    p = built.prompt
    assert p.startswith(
        "Use the given documents to write a concise and short answer to the question. Write "
        "your answer in the following format:\nAnswer: [answer]\n\n"
    )
    question = src.groups[key][0]["question"]
    assert p.endswith(f"\n\nQuestion: {question}\nAnswer:")
    assert built.context_kept == 1.0
    # two demonstrations of three passages each, then the K passages of the question
    assert len(re.findall(r"^Document \(Title: ", p, flags=re.M)) == 2 * 3 + 4
    demo_questions = re.findall(r"\n\nQuestion: (.*)\nAnswer: (.*)\n\n", p)
    assert len(demo_questions) == 2
    pool = [d for d in src.demos if dataset != "kilt_popqa" or d["_key"] != key]
    expected = _hf_shuffle_then_dedup(pool, key, 2)
    assert [q for q, _ in demo_questions] == [d["question"] for d in expected]
    assert [a for _, a in demo_questions] == [d["answers"][0] for d in expected]
    if dataset == "kilt_popqa":
        assert question not in [q for q, _ in demo_questions]
    assert built.answers == tuple(src.groups[key][0]["answers"])
    assert any(a in p.split("Question: " + question)[0] for a in built.answers)


@pytest.mark.parametrize("dataset", ["alce_asqa", "alce_qampari"])
def test_cite_prompt_follows_helmet_template(dataset):
    src = source(dataset)
    pf = src.prompt_file
    key = src.key_order[0]
    row = src.groups[key][0]
    fn = length_fn(word_tokenizer())
    built = H.build_helmet_prompt(src, key, 3, random.Random(0), fn, budget=10_000)
    p = built.prompt
    assert p.count(pf["instruction"]) == 3  # two demonstrations and the task
    demos = p.split("\n\n\n")
    assert len(demos) == 3
    rng = random.Random(0)
    rng.randrange(1)  # the row draw (one row per ALCE question) comes first
    chosen = rng.sample(list(pf["demos"]), 2)
    for block, demo in zip(demos[:2], chosen, strict=True):
        assert block.startswith(pf["instruction"] + "\n\nQuestion: " + demo["question"])
        assert block.endswith("Answer: " + demo["answer"])
        assert len(re.findall(r"Document \[\d\]\(Title: ", block)) == 5
    task = demos[2]
    assert task.startswith(f"{pf['instruction']}\n\nQuestion: {row['question']}\n\n")
    assert re.findall(r"Document \[(\d+)\]\(Title: ", task) == ["1", "2", "3"]
    assert not task.endswith("Answer:")  # chat mode: HELMET leaves the prefix out
    assert H.USES_CHAT_TEMPLATE[dataset] and not H.USES_CHAT_TEMPLATE["kilt_nq"]
    if dataset == "alce_asqa":
        shorts = [a for pair in row["qa_pairs"] for a in pair["short_answers"]]
        assert built.answers == tuple(shorts)
    else:
        assert built.answers == tuple(a[0] for a in row["answers"])


@pytest.mark.parametrize("dataset", ["kilt_nq", "alce_qampari"])
@pytest.mark.parametrize("make", [bpe_tokenizer, word_tokenizer])
def test_truncation_cuts_only_the_context_end_to_the_budget(dataset, make):
    src = source(dataset, 16 if dataset.startswith("kilt") else 14)
    fn = length_fn(make())
    key = src.key_order[1]
    full = H.build_helmet_prompt(src, key, 14, random.Random(3), fn, budget=100_000)
    budget = fn(full.prompt) - 150
    cut = H.build_helmet_prompt(src, key, 14, random.Random(3), fn, budget=budget)
    assert fn(cut.prompt) <= budget
    assert fn(cut.prompt) >= budget - 10  # the longest prefix that fits
    assert 0 < cut.context_kept < 1
    if dataset == "kilt_nq":  # the context is followed by the question
        tail = full.prompt[full.prompt.rindex("\n\nQuestion: ") :]
        assert cut.prompt.endswith(tail)
        head = cut.prompt[: -len(tail)]
    else:  # Cite: the context ends the prompt
        head = cut.prompt
    assert full.prompt.startswith(head)


def test_prompt_without_context_over_budget_is_a_fit_error():
    src = source("alce_asqa")
    fn = length_fn(bpe_tokenizer())
    with pytest.raises(ValueError, match="without its context needs .* over the budget of 50"):
        H.build_helmet_prompt(src, src.key_order[0], 3, random.Random(0), fn, budget=50)


def test_missing_helmet_file_names_helmets_archive(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        H.load_helmet_source("kilt_nq", tmp_path, PROMPTS, 20, seed=1)
    message = str(err.value)
    assert "nq-dev-multikilt_1000_k20_dep6.jsonl" in message
    assert "princeton-nlp/HELMET" in message and "\n" not in message


def test_missing_prompt_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"asqa_revised\.json"):
        H.load_helmet_source("alce_asqa", DATA, tmp_path, 3, seed=1)


def test_row_without_required_field_is_one_line(tmp_path):
    kilt = tmp_path / "kilt"
    kilt.mkdir()
    (kilt / "nq-dev-multikilt_1000_k4_dep6.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="row 0 lacks answers, ctxs"):
        H.load_helmet_source("kilt_nq", tmp_path, PROMPTS, 4, seed=1)


def test_helmet_stratum_has_every_dataset_inside_the_budget():
    cfg = config()
    fn = length_fn(bpe_tokenizer())
    frame = materialize_stratum(cfg, "helmet-1k", fn)
    assert frame.height == 8
    assert set(frame["task"]) == {H.HELMET_TASK_NAMES[d] for d in HELMET_DATASETS}
    budget = 1100 - 32
    assert all(n <= budget for n in frame["n_tokens"])
    assert all(fn(p) == n for p, n in zip(frame["prompt"], frame["n_tokens"], strict=True))
    assert all("(synthetic)" in s for s in frame["source"])
