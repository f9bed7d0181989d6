"""The dataset-environment registry and the `custom` environment (own prompts, JSONL/Parquet)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import polars as pl
import pytest
from datasets_helpers import REPO, config, length_fn, section, word_tokenizer

from kvdiverge.config import validate_config
from kvdiverge.datasets import (
    DOCUMENTS_SCHEMA,
    ENVIRONMENTS,
    DatasetEnvironment,
    DatasetError,
    LengthFitError,
    MissingSourceError,
    materialize_stratum,
    plan_documents,
    register_environment,
    stratum_source_paths,
)
from kvdiverge.datasets.custom import read_custom_records
from kvdiverge.datasets.registry import document_row, environment

SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _records(n: int, context: bool = False) -> list[dict]:
    rows = []
    for i in range(n):
        row = {"id": f"q{i}", "prompt": f"Question {i}: what is the code?", "answers": [f"C{i}"]}
        if context:
            row["prompt"] = "Read this.\n{context}\nWhat is the code?"
            row["context"] = " ".join(f"word{j}" for j in range(400)) + f" The code is C{i}."
        if i % 2:
            row["task"] = "lookup"
        rows.append(row)
    return rows


def _custom(path: Path, **extra) -> dict:
    return {"env": "custom", "label": "own", "target_tokens": 300, "path": str(path), **extra}


# ---- the registry ------------------------------------------------------------------------------


def test_builtin_environments_are_registered():
    assert {"ruler", "helmet", "custom"} <= set(ENVIRONMENTS)
    assert environment("ruler").metric(None, "qa_1") == "string_match_part"
    assert environment("ruler").metric(None, "niah_single_1") == "string_match_all"
    assert environment("helmet").metric(None, "nq") == "substring_exact_match"
    assert environment("helmet").metric(None, "asqa") == "str_em"
    assert environment("helmet").metric(None, "qampari") == "qampari_rec_top5"
    with pytest.raises(DatasetError, match=r"^env: expected one of .*custom.*, got 'nope'$"):
        environment("nope")


def test_a_new_source_is_one_class(tmp_path):
    """Registering a class is all a source needs: the plan and materialization use it."""

    @register_environment
    class Echo(DatasetEnvironment):
        name = "echo-test"
        stratum_keys = ("word",)

        def stratum_options(self, spec, target, where):
            super().stratum_options(spec, target, where)
            return {"options": (("word", spec.get("word", "hi")),)}

        def tasks(self, cfg, stratum):
            return ("a", "b")

        def documents(self, slots, cfg, length_fn, progress):
            word = slots[0].stratum.option("word")
            return [
                document_row(s, f"{word} {s.index}", [word], "echo", s.seed, length_fn(word))
                for s in slots
            ]

        def source_paths(self, cfg, stratum, tasks):
            return []

        def metric(self, stratum, task):
            return "substring_match"

    try:
        strata = [{"env": "echo-test", "label": "x", "target_tokens": 100, "word": "yo"}]
        cfg = config(strata=strata, cohorts={"dev": 1, "study1": 2, "study2": 0})
        assert [s.task for s in plan_documents(cfg)] == ["a", "b", "a"]
        frame = materialize_stratum(cfg, "echo-test-x", lambda p: len(p.split()))
        assert frame["prompt"].to_list() == ["yo 0", "yo 0", "yo 1"]
        assert frame["env"].unique().to_list() == ["echo-test"]
        with pytest.raises(DatasetError, match=r"strata\[0\]: key\(s\) size do not apply"):
            config(strata=[{**strata[0], "size": 3}])
    finally:
        ENVIRONMENTS.pop("echo-test")


def test_unknown_env_is_one_line():
    with pytest.raises(DatasetError) as err:
        config(strata=[{"env": "mine", "label": "a", "target_tokens": 900}])
    assert str(err.value).startswith("config.datasets.strata[0].env: expected one of custom")


# ---- custom: reading ---------------------------------------------------------------------------


def test_jsonl_and_parquet_read_alike(tmp_path):
    rows = _records(3)
    rows[2]["answers"] = "C2"  # one string is one answer
    rows[0]["extra"] = {"ignored": True}
    from_jsonl = read_custom_records(_jsonl(tmp_path / "p.jsonl", rows))
    table = pl.DataFrame(
        {
            "id": [r["id"] for r in rows],
            "prompt": [r["prompt"] for r in rows],
            "answers": [[f"C{i}"] for i in range(3)],
            "task": [r.get("task") for r in rows],
        }
    )
    table.write_parquet(tmp_path / "p.parquet")
    from_parquet = read_custom_records(tmp_path / "p.parquet")
    strip = [(r.prompt, r.answers, r.id, r.task, r.context) for r in from_jsonl]
    assert strip == [(r.prompt, r.answers, r.id, r.task, r.context) for r in from_parquet]
    assert strip[2] == ("Question 2: what is the code?", ("C2",), "q2", "custom", None)
    assert strip[1][3] == "lookup"
    assert from_parquet[1].where.endswith("p.parquet, row 2")


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", r"line 2: not valid JSON"),
        ("[1, 2]", r"line 2: expected a JSON object, got list"),
        ('{"answers": ["a"]}', r"line 2, field 'prompt': missing"),
        ('{"prompt": "  ", "answers": ["a"]}', r"line 2, field 'prompt': empty"),
        ('{"prompt": 3, "answers": ["a"]}', r"line 2, field 'prompt': expected a string, got int"),
        ('{"prompt": "p"}', r"line 2, field 'answers': missing"),
        (
            '{"prompt": "p", "answers": [1]}',
            r"line 2, field 'answers': expected a string or a list",
        ),
        ('{"prompt": "p", "answers": [""]}', r"line 2, field 'answers': expected at least one"),
        ('{"prompt": "p", "answers": "a", "id": 1.5}', r"line 2, field 'id': expected a string"),
        ('{"prompt": "p", "answers": "a", "task": 7}', r"line 2, field 'task': expected a string"),
        ('{"prompt": "p", "answers": "a", "id": "q0"}', r"line 2, field 'id': 'q0' repeats line 1"),
    ],
)
def test_bad_jsonl_records_are_one_line(tmp_path, line, message):
    path = _jsonl(tmp_path / "bad.jsonl", [_records(1)[0], line])
    with pytest.raises(DatasetError) as err:
        read_custom_records(path)
    text = str(err.value)
    assert "\n" not in text and text.startswith(str(path)), text
    assert re.search(message, text), text


def test_bad_files_are_one_line(tmp_path):
    with pytest.raises(MissingSourceError, match=r"absent\.jsonl: no such file"):
        read_custom_records(tmp_path / "absent.jsonl")
    (tmp_path / "p.csv").write_text("prompt,answers\n")
    with pytest.raises(DatasetError, match=r"p\.csv: expected a \.jsonl or \.parquet file"):
        read_custom_records(tmp_path / "p.csv")
    with pytest.raises(DatasetError, match=r"empty\.jsonl: no records"):
        read_custom_records(_jsonl(tmp_path / "empty.jsonl", ["", " "]))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match=r"junk\.parquet: not a readable Parquet file"):
        read_custom_records(tmp_path / "junk.parquet")
    pl.DataFrame({"prompt": ["p"]}).write_parquet(tmp_path / "noanswers.parquet")
    with pytest.raises(DatasetError, match=r"noanswers\.parquet: no column 'answers'"):
        read_custom_records(tmp_path / "noanswers.parquet")
    pl.DataFrame({"prompt": ["p", None], "answers": [["a"], ["b"]]}).write_parquet(
        tmp_path / "null.parquet"
    )
    with pytest.raises(DatasetError, match=r"null\.parquet, row 2, field 'prompt': missing"):
        read_custom_records(tmp_path / "null.parquet")


# ---- custom: the stratum -----------------------------------------------------------------------


def test_custom_stratum_as_given(tmp_path):
    path = _jsonl(tmp_path / "own.jsonl", _records(5))
    cfg = config(strata=[_custom(path)], cohorts={"dev": 1, "study1": 2, "study2": 2})
    fn = length_fn(word_tokenizer())
    frame = materialize_stratum(cfg, "custom-own", fn)
    assert frame.schema == pl.Schema(DOCUMENTS_SCHEMA)
    assert frame["doc_id"].to_list() == [
        "custom-own/dev/000",
        "custom-own/study1/000",
        "custom-own/study1/001",
        "custom-own/study2/000",
        "custom-own/study2/001",
    ]
    assert frame["prompt"].to_list() == [r["prompt"] for r in _records(5)]
    assert frame["answers"].to_list() == [[f"C{i}"] for i in range(5)]
    assert frame["task"].to_list() == ["custom", "lookup", "custom", "lookup", "custom"]
    assert frame["source"][1] == f"custom:{path}#q1"
    assert frame["n_tokens"].to_list() == [fn(p) for p in frame["prompt"]]
    assert stratum_source_paths(cfg, "custom-own") == [path]
    assert environment("custom").metric(cfg.strata[0], "x") == "substring_match"


def test_custom_stratum_truncates_the_context(tmp_path):
    path = _jsonl(tmp_path / "own.jsonl", _records(2, context=True))
    cfg = config(strata=[_custom(path, fit="truncate")], cohorts={"dev": 0, "study1": 2})
    fn = length_fn(word_tokenizer())
    frame = materialize_stratum(cfg, "custom-own", fn)
    assert (frame["n_tokens"] <= 300 - 32).all() and (frame["n_tokens"] >= 300 - 40).all()
    assert all(p.startswith("Read this.\nword0 word1") for p in frame["prompt"])
    assert all("{context}" not in p for p in frame["prompt"])
    assert all("context_kept=0." in s for s in frame["source"])
    as_given = config(strata=[_custom(path)], cohorts={"dev": 0, "study1": 2})
    with pytest.raises(LengthFitError) as err:  # the whole context does not fit as given
        materialize_stratum(as_given, "custom-own", fn)
    assert "own.jsonl, line 1: the prompt needs" in str(err.value)
    assert "over the budget of 268" in str(err.value) and "\n" not in str(err.value)


def _never_called(prompt: str) -> int:
    raise AssertionError("the length function ran before the records were checked")


def test_custom_stratum_errors_come_before_any_tokenization(tmp_path):
    path = _jsonl(tmp_path / "own.jsonl", _records(2))
    cohorts = {"dev": 1, "study1": 2, "study2": 0}
    with pytest.raises(DatasetError, match=r"plan needs 3 documents but .* holds 2 records"):
        materialize_stratum(
            config(strata=[_custom(path)], cohorts=cohorts), "custom-own", _never_called
        )
    cohorts = {"dev": 0, "study1": 2, "study2": 0}
    truncate = config(strata=[_custom(path, fit="truncate")], cohorts=cohorts)
    with pytest.raises(DatasetError, match=r"line 1, field 'context': missing \(fit: truncate"):
        materialize_stratum(truncate, "custom-own", _never_called)
    rows = _records(2, context=True)
    rows[1]["prompt"] = "no placeholder"
    bad = _jsonl(tmp_path / "noplace.jsonl", rows)
    with pytest.raises(DatasetError, match=r"line 2, field 'prompt': expected \{context\} once"):
        materialize_stratum(
            config(strata=[_custom(bad)], cohorts=cohorts), "custom-own", _never_called
        )


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"path": None}, r"strata\[0\]\.path: a custom stratum needs the file"),
        ({"path": "p.txt"}, r"strata\[0\]\.path: expected a \.jsonl or \.parquet file"),
        ({"fit": "grow"}, r"strata\[0\]\.fit: expected one of as_given, truncate"),
        ({"metric": "bleu"}, r"strata\[0\]\.metric: expected one of .*got 'bleu'"),
        ({"rag_passages": 4}, r"rag_passages do not apply to env custom"),
    ],
)
def test_custom_stratum_config_errors(extra, message):
    with pytest.raises(DatasetError, match=message) as err:
        config(strata=[{**_custom(Path("p.jsonl")), **extra}])
    assert "\n" not in str(err.value)


def test_schema_accepts_a_custom_stratum_and_rejects_a_bad_fit():
    good = {"datasets": section(strata=[_custom(Path("p.jsonl"), fit="truncate")])}
    validate_config(good, SCHEMA)
    bad = {"datasets": section(strata=[_custom(Path("p.jsonl"), fit="grow")])}
    with pytest.raises(ValueError, match=r"strata\[0\]\.fit"):
        validate_config(bad, SCHEMA)


def test_custom_strata_plan_from_their_own_files(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", _records(2))
    b = _jsonl(tmp_path / "b.jsonl", _records(2))
    strata = [_custom(a), {**_custom(b), "label": "two"}]
    cfg = config(strata=strata, cohorts={"dev": 0, "study1": 2, "study2": 0})
    assert [s.source_index for s in plan_documents(cfg)] == [0, 1, 0, 1]


def test_the_custom_fixture_reads_and_fits():
    path = REPO / "data" / "fixtures" / "custom" / "prompts.jsonl"
    records = read_custom_records(path)
    assert len(records) == 12 and all("{context}" in r.prompt for r in records)
    assert {r.task for r in records} == {"founder", "year"}
    assert all(r.answers[0] in r.context for r in records)  # the answer is in the passages
    strata = [{**_custom(path, fit="truncate"), "target_tokens": 160}]
    cfg = config(strata=strata, cohorts={"dev": 2, "study1": 2, "study2": 2})
    frame = materialize_stratum(cfg, "custom-own", length_fn(word_tokenizer()))
    assert frame.height == 6 and (frame["n_tokens"] <= 160 - 32).all()
    assert frame["source"][0].startswith(f"custom:{path}#synthetic-custom-00 context_kept=")
