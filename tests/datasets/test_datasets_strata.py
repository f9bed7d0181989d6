"""Strata, cohorts and the plan: exact and disjoint cohorts, deterministic ids, balanced task
mix with full coverage in the embedded default, config errors before any work, and the
documents table contract."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import polars as pl
import pytest
import yaml
from datasets_helpers import REPO, bpe_tokenizer, config, length_fn, section, word_tokenizer

from kvdiverge.config import validate_config
from kvdiverge.datasets import (
    COHORTS,
    DOCUMENTS_SCHEMA,
    HELMET_DATASETS,
    RULER_TASKS,
    DatasetError,
    DatasetsConfig,
    DocumentsFormatError,
    materialize_stratum,
    plan_documents,
    read_documents,
    stratum_source_paths,
    write_documents,
)


def default_config() -> DatasetsConfig:
    cfg = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    validate_config(cfg, REPO / "workflow" / "schemas" / "config.schema.yaml")
    return DatasetsConfig.from_config(cfg["datasets"])


def test_embedded_default_covers_all_tasks_and_datasets():
    cfg = default_config()
    plan = plan_documents(cfg)
    ruler = {s.task for s in plan if s.stratum.env == "ruler"}
    assert ruler == set(RULER_TASKS)
    for stratum in cfg.strata:
        tasks = [s.task for s in plan if s.stratum == stratum]
        assert len(tasks) == sum(cfg.cohorts.values())
        if stratum.env == "helmet":
            assert set(tasks) == set(HELMET_DATASETS)


def test_schema_defaults_are_the_paper_design():
    cfg = {"seed": 1}
    validate_config(cfg, REPO / "workflow" / "schemas" / "config.schema.yaml")
    ds = DatasetsConfig.from_config(cfg["datasets"])
    assert ds.cohorts == {"dev": 6, "study1": 48, "study2": 48}
    assert [s.name for s in ds.strata] == [
        f"{e}-{n}" for e in ("helmet", "ruler") for n in ("4k", "16k", "32k")
    ]
    helmet = [s for s in ds.strata if s.env == "helmet"]
    assert [(s.rag_passages, s.cite_documents) for s in helmet] == [(20, 8), (105, 75), (220, 165)]
    assert ds.generation_reserve == 128 and ds.ruler_tasks == RULER_TASKS
    plan = plan_documents(ds)
    assert len(plan) == 6 * 102
    for stratum in ds.strata:  # balanced: task counts differ by at most one
        counts = Counter(s.task for s in plan if s.stratum == stratum)
        assert len(counts) == len(ds.tasks(stratum.env))
        assert max(counts.values()) - min(counts.values()) <= 1


def test_cohorts_are_exact_ids_deterministic_and_sources_disjoint():
    cfg = config(cohorts={"dev": 3, "study1": 5, "study2": 4})
    plan = plan_documents(cfg)
    assert plan == plan_documents(config(cohorts={"dev": 3, "study1": 5, "study2": 4}))
    for stratum in cfg.strata:
        for cohort, n in zip(COHORTS, (3, 5, 4), strict=True):
            ids = [s.doc_id for s in plan if s.stratum == stratum and s.cohort == cohort]
            assert ids == [f"{stratum.name}/{cohort}/{i:03d}" for i in range(n)]
    assert len({s.doc_id for s in plan}) == len(plan)
    assert len({s.seed for s in plan}) == len(plan)
    items = [(s.stratum.env, s.task, s.source_index) for s in plan]
    assert len(set(items)) == len(items)  # no source item twice, so never in two cohorts


def test_materialized_cohorts_share_no_question_or_needle():
    strata = [{"env": "ruler", "label": "a", "target_tokens": 1600}, section()["strata"][1]]
    cfg = config(cohorts={"dev": 4, "study1": 5, "study2": 5}, strata=strata)
    fn = length_fn(bpe_tokenizer())
    for stratum in cfg.strata:
        frame = materialize_stratum(cfg, stratum.name, fn)
        assert frame.group_by("cohort").len().sort("cohort").rows() == [
            ("dev", 4),
            ("study1", 5),
            ("study2", 5),
        ]
        questions = [p.rsplit("Question: ", 1)[-1] for p in frame["prompt"]]
        by_cohort = {c: set() for c in COHORTS}
        for cohort, question, answers in zip(
            frame["cohort"], questions, frame["answers"], strict=True
        ):
            if "Question: " in question or stratum.env == "helmet":
                by_cohort[cohort].add(question.split("\n\n")[0])
            if stratum.env == "ruler":  # needle keys/values, names, coded words
                by_cohort[cohort] |= {a for a in answers if len(a) >= 5}
        assert not by_cohort["dev"] & by_cohort["study1"]
        assert not by_cohort["dev"] & by_cohort["study2"]
        assert not by_cohort["study1"] & by_cohort["study2"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            {"ruler": {"tasks": ["niah_single_1", "niah_single_9"]}},
            "unknown task(s) 'niah_single_9'",
        ),
        ({"helmet": {"datasets": ["kilt_msmarco"]}}, "unknown dataset(s) 'kilt_msmarco'"),
        ({"strata": [{"env": "ruler", "label": "a", "target_tokens": 30}]}, "leaves no room"),
        (
            {"strata": [{"env": "helmet", "label": "x", "target_tokens": 3000}]},
            "needs rag_passages and cite_documents",
        ),
        (
            {"strata": [{"env": "ruler", "label": "a", "target_tokens": 900}] * 2},
            "duplicate stratum ruler-a",
        ),
    ],
)
def test_config_errors_are_one_line(overrides, message):
    with pytest.raises(DatasetError) as err:
        config(**overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_schema_rejects_unknown_task_before_anything_runs():
    cfg = {"datasets": section(ruler={"tasks": ["niah_single_9"]})}
    with pytest.raises(ValueError, match=r"config\.datasets\.ruler\.tasks\[0\]: expected one of"):
        validate_config(cfg, REPO / "workflow" / "schemas" / "config.schema.yaml")


def _never_called(prompt: str) -> int:
    raise AssertionError("the length function ran before the configuration was checked")


@pytest.mark.parametrize("stratum", ["ruler-1k", "helmet-1k"])
def test_more_documents_than_the_source_holds_fails_before_any_work(stratum):
    if stratum == "ruler-1k":
        cfg = config(
            ruler={**section()["ruler"], "tasks": ["qa_2"]}, cohorts={"dev": 6, "study1": 6}
        )
        held = "holds 10"
    else:
        cfg = config(helmet={**section()["helmet"], "datasets": ["kilt_nq"]})
        held = "holds 6"
    with pytest.raises(DatasetError) as err:
        materialize_stratum(cfg, stratum, _never_called)
    assert "needs" in str(err.value) and held in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_source_fails_before_any_work(tmp_path):
    cfg = config(helmet={"data_dir": str(tmp_path), "prompts_dir": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match="HELMET's data archive"):
        materialize_stratum(cfg, "helmet-1k", _never_called)
    ruler = {**section()["ruler"], "squad": str(tmp_path / "dev-v2.0.json"), "tasks": ["qa_1"]}
    with pytest.raises(FileNotFoundError, match="SQuAD"):
        materialize_stratum(config(ruler=ruler), "ruler-1k", _never_called)


def test_unknown_stratum_names_the_configured_ones():
    with pytest.raises(DatasetError, match="expected one of ruler-1k, helmet-1k"):
        materialize_stratum(config(), "ruler-99k", _never_called)


def test_stratum_source_paths_name_the_files_read():
    cfg = config()
    helmet = {p.name for p in stratum_source_paths(cfg, "helmet-1k")}
    assert "nq-dev-multikilt_1000_k4_dep6.jsonl" in helmet and "asqa_revised.json" in helmet
    ruler = stratum_source_paths(cfg, "ruler-1k")
    assert all(p.exists() for p in ruler) and any(p.suffix == ".txt" for p in ruler)


def test_documents_round_trip_and_format_errors(tmp_path):
    frame = materialize_stratum(config(), "helmet-1k", length_fn(bpe_tokenizer()))
    assert frame.schema == pl.Schema(DOCUMENTS_SCHEMA)
    path = tmp_path / "docs" / "helmet-1k.parquet"
    write_documents(frame, path, metadata={"length_tokenizer": "test"})
    assert read_documents(path).equals(frame)
    assert [p.name for p in path.parent.iterdir()] == ["helmet-1k.parquet"]  # atomic: no temp
    frame.drop("answers").write_parquet(tmp_path / "bad.parquet")
    with pytest.raises(DocumentsFormatError, match="missing document column"):
        read_documents(tmp_path / "bad.parquet")
    pl.concat([frame, frame]).write_parquet(tmp_path / "dup.parquet")
    with pytest.raises(DocumentsFormatError, match="not unique"):
        read_documents(Path(tmp_path / "dup.parquet"))


def test_documents_do_not_depend_on_the_process(tmp_path):
    """Same table from a fresh interpreter with another hash seed (no set-order leaks)."""
    script = (
        "import sys, hashlib; sys.path.insert(0, 'tests');"
        "from datasets_helpers import config, length_fn, word_tokenizer;"
        "from kvdiverge.datasets import materialize_stratum;"
        "fn = length_fn(word_tokenizer());"
        "print(hashlib.sha256(''.join(''.join(materialize_stratum(config(), s, fn)['prompt'])"
        " for s in ('ruler-1k', 'helmet-1k')).encode()).hexdigest())"
    )
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr[-2000:]
        digests.add(out.stdout.strip())
    fn = length_fn(word_tokenizer())
    here = "".join(
        "".join(materialize_stratum(config(), s, fn)["prompt"]) for s in ("ruler-1k", "helmet-1k")
    )
    assert digests == {hashlib.sha256(here.encode()).hexdigest()}
