"""RULER's 13 tasks: gold answers in the context as templated, the question asking for them,
lengths inside the band under two tokenizers, determinism, and the length-fit error."""

from __future__ import annotations

import random
import re
from collections import Counter

import polars as pl
import pytest
from datasets_helpers import FIXTURES, bpe_tokenizer, config, length_fn, word_tokenizer

from kvdiverge.datasets import LengthFitError, materialize_stratum
from kvdiverge.datasets import ruler as R

ESSAYS = R.load_essays(FIXTURES / "essays")
SQUAD = R.load_squad(FIXTURES / "squad" / "dev-v2.0.json")
HOTPOT = R.load_hotpotqa(FIXTURES / "hotpotqa" / "hotpot_dev_distractor_v1.json")


def build(task: str, units: int, seed: int = 3, target: int = 2048, **kw) -> R.RulerSample:
    qa = {"qa_1": SQUAD, "qa_2": HOTPOT}.get(task)
    return R.build_ruler_prompt(
        task,
        units,
        random.Random(seed),
        target_tokens=target,
        budget=target - 64,
        vocab_seed=5,
        essays=ESSAYS,
        qa=qa,
        question_index=kw.get("question_index", 0),
        example_units=2,
    )


NIAH_COUNTS = {  # task: (keys, values per key, queries, value pattern, singular)
    "niah_single_1": (1, 1, 1, r"\d{7}", True),
    "niah_single_2": (1, 1, 1, r"\d{7}", True),
    "niah_single_3": (1, 1, 1, r"[0-9a-f-]{36}", True),
    "niah_multikey_1": (4, 1, 1, r"\d{7}", True),
    "niah_multikey_2": (1, 1, 1, r"\d{7}", True),
    "niah_multikey_3": (1, 1, 1, r"[0-9a-f-]{36}", True),
    "niah_multivalue": (1, 4, 1, r"\d{7}", False),
    "niah_multiquery": (4, 1, 4, r"\d{7}", False),
}


@pytest.mark.parametrize("task", list(NIAH_COUNTS))
def test_niah_answers_are_needles_and_the_question_asks_for_them(task):
    n_keys, n_values, n_queries, pattern, singular = NIAH_COUNTS[task]
    sample = build(task, 120)
    value_type = "uuids" if "[0-9a-f-]" in pattern else "numbers"
    assert len(sample.answers) == n_values * n_queries
    head = "A special magic" if singular else "Some special magic"
    assert sample.prompt.startswith(head)
    noun = value_type[:-1] if singular else value_type
    question = re.search(
        rf"What (?:is|are all) the special magic {noun} for (.+) mentioned in the provided text\?",
        sample.prompt,
    )
    assert question is not None
    queried = re.split(r", and |, ", question.group(1))
    assert len(queried) == n_queries
    assert sample.prompt.endswith(
        f"The special magic {noun} for {question.group(1)} mentioned in the provided text "
        + ("is" if singular else "are")
    )
    for answer in sample.answers:
        assert re.fullmatch(pattern, answer)
        # the needle sentence is always plural and binds a queried key to the answer
        assert any(
            f"One of the special magic {value_type} for {key} is: {answer}." in sample.prompt
            for key in queried
        )
    # distractor needles (multikey_1's other keys) must not bind a queried key to a non-answer
    needles = re.findall(rf"for (\S+) is: ({pattern})\.", sample.prompt)
    for key, value in needles:
        if key in queried:
            assert value in sample.answers
    if task == "niah_multikey_2":  # needle haystack: many distractor needles
        assert len(needles) > 20
    if task == "niah_multikey_1":
        assert len({k for k, _ in needles}) == 4


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multivalue"])
def test_essay_needles_sit_between_sentences(task):
    sample = build(task, 300)
    context = sample.prompt.split("\n")[1]
    for match in re.finditer(r"One of the special magic", context):
        before = context[: match.start()]
        assert before == "" or before.endswith((". ", "? ", "! ", '." ', ".) "))


def test_vt_chain_gives_the_answers():
    sample = build("vt", 30)
    head = "Memorize and track the chain(s) of variable assignment"
    main = head + sample.prompt.rsplit(head, 1)[1]
    value = re.search(r"assigned the value (\d{5}) in the text above", main).group(1)
    names = list(sample.answers)
    assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
    assert f"VAR {names[0]} = {value}" in main
    for a, b in zip(names, names[1:], strict=False):
        assert f"VAR {b} = VAR {a} " in main
    assert main.endswith(f"5 variables are assigned the value {value}, they are: ")
    # the one-shot example precedes the task, with its own 3-letter chain and answer
    example = sample.prompt[: sample.prompt.index(main)]
    assert re.search(r"they are: [A-Z]{3}( [A-Z]{3}){4}\n", example)


@pytest.mark.parametrize("target,common,uncommon", [(2048, 6, 1), (8192, 30, 3)])
def test_cwe_answers_are_the_ten_most_common_words(target, common, uncommon):
    sample = build("cwe", 25, target=target)
    main = sample.prompt.rsplit("Below is a numbered list of words.", 1)[1]
    listing = main.split("\n")[1]
    words = re.findall(r"\d+\. (\S+)", listing)
    counts = Counter(words)
    assert len(counts) == 25
    assert {w for w, c in counts.items() if c == common} == set(sample.answers)
    assert all(c == uncommon for w, c in counts.items() if w not in sample.answers)
    assert main.endswith("Answer: The top 10 words that appear most often in the list are:")


def test_fwe_answers_are_ranks_two_to_four():
    sample = build("fwe", 400)
    context = sample.prompt.split("three most frequently appeared coded words. ")[1].split(
        "\nQuestion:"
    )[0]
    counts = Counter(context.split(" "))
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..."
    assert counts[ranked[1]] > counts[ranked[4]]
    assert set(ranked[1:4]) == set(sample.answers)
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in sample.answers)


@pytest.mark.parametrize("task,source", [("qa_1", SQUAD), ("qa_2", HOTPOT)])
def test_qa_gold_documents_and_question(task, source):
    for qi in range(3):
        sample = build(task, 12, question_index=qi)
        q = source.questions[qi]
        assert sample.prompt.endswith(f"Question: {q['query']} Answer:")
        assert tuple(q["outputs"]) == sample.answers
        for gold in q["context"]:
            assert source.documents[gold] in sample.prompt
        assert any(a in sample.prompt for a in sample.answers)
        docs = re.findall(r"Document (\d+):\n", sample.prompt)
        assert docs == [str(i + 1) for i in range(max(12, len(q["context"])))]


def test_squad_loader_keeps_answerable_questions_and_dedups_documents():
    assert all(q["outputs"] for q in SQUAD.questions)
    assert len(SQUAD.documents) == len(set(SQUAD.documents)) == 32
    assert list(SQUAD.documents) == sorted(SQUAD.documents)
    assert len(SQUAD.questions) == 64  # two answerable of three questions per paragraph
    q = SQUAD.questions[0]
    assert len(q["more_context"]) == 3 and q["context"][0] not in q["more_context"]


def test_hotpotqa_gold_context_is_all_ten_paragraphs():
    assert all(len(q["context"]) == 10 for q in HOTPOT.questions)
    sample = build("qa_2", 1)  # below the gold count: all ten still there
    assert len(re.findall(r"Document \d+:\n", sample.prompt)) == 10


def test_wonderwords_keys_are_adjective_noun_pairs():
    lists = R.wonderwords_lists()
    assert len(lists["adjectives"]) == 910 and len(lists["nouns"]) == 6782  # distinct words
    sample = build("niah_single_1", 40)
    key = re.search(r"for (\S+) is: ", sample.prompt).group(1)
    adj, noun = key.split("-", 1)
    assert adj in lists["adjectives"] and noun in lists["nouns"]


TOKENIZERS = {"bpe": bpe_tokenizer, "word": word_tokenizer}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def ruler_strata(request):
    """Three RULER strata covering all 13 tasks, materialized under one test tokenizer."""
    fn = length_fn(TOKENIZERS[request.param]())
    cfg = config(
        strata=[
            {"env": "ruler", "label": "a", "target_tokens": 1400},
            {"env": "ruler", "label": "b", "target_tokens": 1800},
        ],
        cohorts={"dev": 2, "study1": 3, "study2": 3},
    )
    frames = [materialize_stratum(cfg, s.name, fn) for s in cfg.strata]
    return cfg, fn, pl.concat(frames)


def test_all_tasks_fit_inside_the_band(ruler_strata):
    cfg, fn, frame = ruler_strata
    assert set(frame["task"]) == set(R.RULER_TASKS)
    for row in frame.iter_rows(named=True):
        budget = row["target_tokens"] - cfg.generation_reserve
        n = fn(row["prompt"])
        assert n == row["n_tokens"]
        assert n <= budget
        source = {"qa_1": SQUAD, "qa_2": HOTPOT}.get(row["task"])
        n_docs = len(re.findall(r"^Document \d+:$", row["prompt"], flags=re.M))
        if source is not None and n_docs == len(source.documents):
            continue  # the (small fixture) source is exhausted: the prompt cannot be longer
        assert 0.8 * budget <= n, (row["task"], n, budget)


def test_materialization_is_deterministic(ruler_strata):
    cfg, fn, frame = ruler_strata
    again = materialize_stratum(cfg, cfg.strata[0].name, fn)
    assert again.equals(frame.filter(pl.col("stratum") == cfg.strata[0].name))
    other = materialize_stratum(config(seed=12, strata=[cfg.strata[0].__dict__]), "ruler-a", fn)
    assert set(other["prompt"]).isdisjoint(set(again["prompt"]))


def test_needles_are_not_shared_between_documents(ruler_strata):
    _, _, frame = ruler_strata
    for stratum in frame["stratum"].unique():
        part = frame.filter(pl.col("stratum") == stratum)
        answers = [a for row in part["answers"] for a in row if re.fullmatch(r"\d{7}|\S{36}", a)]
        assert len(answers) == len(set(answers))


def test_a_length_the_tokenizer_cannot_fit_is_one_clear_line():
    fn = length_fn(bpe_tokenizer())
    cfg = config(strata=[{"env": "ruler", "label": "tiny", "target_tokens": 400}])
    calls = []

    def counting(prompt: str) -> int:
        calls.append(1)
        return fn(prompt)

    with pytest.raises(LengthFitError) as err:
        materialize_stratum(cfg, "ruler-tiny", counting)
    message = str(err.value)
    assert "\n" not in message
    assert "ruler-tiny" in message and "budget of 368" in message
    assert len(calls) <= 8  # the feasibility check fails before any search or document


def test_missing_essay_folder_names_the_source(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"essay_dir: no folder .*data/fixtures/essays.*PaulGrahamEssays"
    ):
        R.load_essays(tmp_path / "none")


def test_synthetic_prose_when_no_essay_folder():
    fn = length_fn(word_tokenizer())
    sec = {"essay_dir": None, "squad": "x", "hotpotqa": "y", "tasks": ["niah_single_2"]}
    cfg = config(ruler=sec, strata=[{"env": "ruler", "label": "s", "target_tokens": 900}])
    frame = materialize_stratum(cfg, "ruler-s", fn)
    assert frame.height == 8 and all("synthetic-prose" in s for s in frame["source"])
    essay_sources = [
        s for s in materialize_stratum(config(), "ruler-1k", fn)["source"] if "essays" in s
    ]  # the committed essays are real prose: not tagged synthetic
    assert essay_sources and all(
        s.endswith(" essays:" + str(FIXTURES / "essays")) for s in essay_sources
    )


@pytest.mark.parametrize(
    "name,loader,origin",
    [("squad", R.load_squad, "rajpurkar"), ("hotpotqa", R.load_hotpotqa, "hotpot_dev")],
)
def test_missing_qa_file_names_where_it_comes_from(tmp_path, name, loader, origin):
    with pytest.raises(FileNotFoundError, match=rf"datasets\.ruler\.{name}: .*{origin}"):
        loader(tmp_path / "missing.json")


def test_malformed_qa_file_is_one_line(tmp_path):
    bad = tmp_path / "dev.json"
    bad.write_text('{"data": [{"title": "x"}]}')
    with pytest.raises(ValueError, match="not in SQuAD v2 format") as err:
        R.load_squad(bad)
    assert "\n" not in str(err.value)
