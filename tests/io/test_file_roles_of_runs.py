"""Stored files checked for their role where they are read: the study and the cohort a
trajectory or SWRB record file holds (a file copied from one study's folder to another's, or a
development file over an evaluation file, stops in one line), the SWRB records' token ids
against the model's vocabulary, and compare's bound on --K (the pipeline's bound on a config's
replicates)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from kvdiverge.analysis.accuracy import accuracy_document_stats
from kvdiverge.analysis.document_stats import document_stats
from kvdiverge.analysis.statistic_registry import AnalysisInputError
from kvdiverge.io.parquet import write_parquet_with_metadata
from kvdiverge.io.swrb_records import SwrbFormatError, read_swrb_metadata, read_swrb_records
from kvdiverge.io.trajectories import read_trajectory_metadata
from kvdiverge.pipeline.extremes import MAX_FILE_ROWS

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "data" / "models" / "tiny-llama"
PROMPT = "The river flows north past the old mill and the stone bridge. " * 3


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """A greedy compare run on the tiny model: its folder (trajectory files of two actions)."""
    from kvdiverge.compare import compare

    folder = tmp_path_factory.mktemp("compare")
    prompts = folder / "p.jsonl"
    lines = [json.dumps({"prompt": PROMPT + str(i), "answers": ["mill"]}) for i in range(2)]
    prompts.write_text("\n".join(lines) + "\n")
    compare(MODEL, prompts, ["recent@0.5"], K=1, H=4, draws=10, temperature=0,
            out=folder / "out", quiet=True)  # fmt: skip
    return folder / "out"


def _documents(out: Path) -> pl.DataFrame:
    return pl.read_parquet(out / "documents.parquet")


def test_compare_records_its_study_and_reads_its_files_as_its_own(compared):
    meta = read_trajectory_metadata(compared / "trajectories" / "recent@0.5.parquet")
    assert meta["study"] == "compare" and meta["model"]["name"] == "tiny-llama"


def test_a_trajectory_file_of_another_study_stops_in_one_line(compared):
    path = compared / "trajectories" / "recent@0.5.parquet"
    files = {"recent@0.5": [path]}
    with pytest.raises(AnalysisInputError) as err:
        document_stats(files, _documents(compared), role={"study": "study2"})
    assert str(err.value) == (
        f"{path}: its metadata says study 'compare', but it is read as the trajectory file of "
        "study 'study2'; expected the file written for study 'study2' (files swapped or copied "
        "under another name: rerun that job)"
    )
    # read as its own study it passes
    stats, _ = document_stats(files, _documents(compared), role={"study": "compare"})
    assert stats.height == 2


def test_a_file_of_another_cohort_stops_in_one_line(compared):
    path = compared / "trajectories" / "recent@0.5.parquet"
    files = {"recent@0.5": [path]}
    with pytest.raises(AnalysisInputError) as err:  # an evaluation file where dev is expected
        document_stats(files, _documents(compared), cohorts={str(path): "dev"})
    assert str(err.value) == (
        f"{path}: holds documents of cohort 'study1', but it is read as the trajectory file of "
        "cohort dev; expected only its documents (files swapped or copied under another name: "
        "rerun that job)"
    )
    # the same path spelled with ./ segments is the same file
    spelled = str(path.parent) + "/./" + path.name
    with pytest.raises(AnalysisInputError, match="cohort dev"):
        document_stats(files, _documents(compared), cohorts={spelled: "dev"})
    stats, _ = document_stats(files, _documents(compared), cohorts={str(path): "study1"})
    assert set(stats["cohort"]) == {"study1"}


def test_accuracy_reads_each_file_as_its_study_model_and_cohort(compared):
    path = compared / "trajectories" / "recent@0.5.parquet"
    docs = _documents(compared).with_columns(
        answers=pl.lit(["mill"]), metric=pl.lit("string_match_all")
    )
    files = {"recent@0.5": [path]}
    with pytest.raises(AnalysisInputError, match=r"says study 'compare'.* study 'study1'"):
        accuracy_document_stats(files, docs, None, 2, role={"study": "study1"})
    with pytest.raises(AnalysisInputError, match=r"holds documents of cohort 'study1'.* study2"):
        accuracy_document_stats(files, docs, None, 2, role={"cohort": "study2"})
    with pytest.raises(AnalysisInputError, match=r"says model 'tiny-llama'.* model 'other'"):
        accuracy_document_stats(files, docs, None, 2, role={"model": "other"})


def test_compare_K_beyond_one_file_is_refused_before_any_work(tmp_path):
    from kvdiverge.compare import CompareError, compare

    K = 2**40
    with pytest.raises(CompareError) as err:  # the prompts file does not exist: never read
        compare(MODEL, tmp_path / "none.jsonl", "recent@0.5", K=K, H=4, out=tmp_path / "o")
    assert str(err.value) == (
        f"--K: {K} replicates of 1 prompt at --H 4 are {K * 4} rows in one trajectory file; "
        f"expected at most {MAX_FILE_ROWS // 4} replicates (a file holds at most "
        f"{MAX_FILE_ROWS} rows)"
    )
    assert not (tmp_path / "o").exists()


def test_compare_K_is_bounded_by_the_prompts_it_reads(tmp_path):
    """Two prompts: K · H · 2 rows per file, refused once the prompts are read (no model)."""
    from kvdiverge.compare import CompareError, compare

    prompts = tmp_path / "p.jsonl"
    records = [{"prompt": PROMPT + str(i), "answers": ["mill"]} for i in range(2)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    K = MAX_FILE_ROWS // 8 + 1  # one prompt's file fits, two prompts' does not
    with pytest.raises(CompareError) as err:
        compare(MODEL, prompts, "recent@0.5", K=K, H=4, out=tmp_path / "o")
    assert str(err.value) == (
        f"--K: {K} replicates of 2 prompts at --H 4 are {K * 8} rows in one trajectory file; "
        f"expected at most {MAX_FILE_ROWS // 8} replicates (a file holds at most "
        f"{MAX_FILE_ROWS} rows)"
    )


@pytest.fixture(scope="module")
def swrb_files(tmp_path_factory):
    """SWRB record files of two actions on the tiny model, study1's evaluation cohort."""
    from kvdiverge.engine.swrb_job import run_swrb_job

    folder = tmp_path_factory.mktemp("swrb")
    documents = folder / "documents.parquet"
    pl.DataFrame(
        {
            "doc_id": ["rag-4k/study1/0", "rag-4k/study1/1"],
            "stratum": ["rag-4k", "rag-4k"],
            "cohort": ["study1", "study1"],
            "prompt": [PROMPT, PROMPT + " Again."],
        }
    ).write_parquet(documents)
    actions = {"full": {"selector": "full"}, "recent-half": {"selector": "recent", "budget": 0.5}}
    out = {name: folder / f"{name}.parquet" for name in actions}
    run_swrb_job(
        documents,
        out,
        {"path": str(MODEL), "name": "tiny-llama", "dtype": "float32"},
        actions,
        {name: {"study1": 2} for name in actions},
        H=4,
        seed=1,
        device="cpu",
        metadata={"study": "study1"},
    )
    return out


def test_swrb_records_hold_the_vocab_size_and_ids_beyond_it_stop(swrb_files, tmp_path):
    from kvdiverge.models import load_model

    path = swrb_files["recent-half"]
    meta = read_swrb_metadata(path)
    rows = load_model(str(MODEL), device="cpu", dtype="float32").get_output_embeddings()
    assert meta["vocab_size"] == rows.weight.shape[0]
    frame = read_swrb_records(path)
    assert int(frame["x_token"].list.max().max()) < meta["vocab_size"]
    bad = tmp_path / "bad.parquet"
    tokens = frame["x_token"].to_list()
    tokens[0] = [meta["vocab_size"], *tokens[0][1:]]
    changed = frame.with_columns(pl.Series("x_token", tokens, dtype=frame["x_token"].dtype))
    write_parquet_with_metadata(changed, bad, meta)  # verified as written: only the ids are off
    with pytest.raises(SwrbFormatError) as err:
        read_swrb_records(bad)
    assert str(err.value) == (
        f"{bad}: x_token holds token id {meta['vocab_size']}; expected token ids below the "
        f"model's vocab_size {meta['vocab_size']} (the file's metadata)"
    )


def test_swrb_study_table_reads_each_file_as_its_study_stratum_and_cohort(swrb_files):
    from kvdiverge.analysis.swrb import swrb_study_table

    files = {"tiny-llama": {name: {"rag-4k": path} for name, path in swrb_files.items()}}
    table = swrb_study_table(files, draws=5, role={"study": "study1", "cohort": "study1"})
    assert set(table["action"]) >= {"full", "recent-half"}
    with pytest.raises(SwrbFormatError, match=r"says study 'study1'.* study 'study2'"):
        swrb_study_table(files, draws=5, role={"study": "study2"})
    with pytest.raises(SwrbFormatError, match=r"holds documents of cohort 'study1'.* dev"):
        swrb_study_table(files, draws=5, role={"cohort": "dev"})
    swapped = {"tiny-llama": {name: {"rag-8k": path} for name, path in swrb_files.items()}}
    with pytest.raises(SwrbFormatError, match=r"holds documents of stratum 'rag-4k'.* rag-8k"):
        swrb_study_table(swapped, draws=5)
    crossed = {"tiny-llama": {"full": {"rag-4k": swrb_files["recent-half"]}}}
    with pytest.raises(SwrbFormatError, match=r"says action 'recent-half'.* action 'full'"):
        swrb_study_table(crossed, draws=5)
