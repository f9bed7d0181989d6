"""Stored files out of their role (synthetic files): every trajectory, SWRB record
and document-statistics file is checked against where it is read (its metadata names its own
model, action and study; its documents their stratum and cohort), so two actions' files swapped
under each other's names stop in one line; token ids lie in [0, vocab_size) of the model that
wrote them (kvdiverge.io.roles)."""

from __future__ import annotations

import shutil

import numpy as np
import polars as pl
import pytest
from refusal_helpers import one_line

from kvdiverge.analysis.document_stats import (
    AnalysisInputError,
    Clock,
    document_stats,
    read_document_stats,
    write_document_stats,
)
from kvdiverge.io.roles import role_problem, token_ids_problem
from kvdiverge.io.trajectories import (
    TRAJECTORY_SCHEMA,
    TrajectoryFormatError,
    read_trajectories,
    write_trajectories,
)

H, K = 4, 2
DOCS = ["ruler-1024/study1/000", "ruler-1024/study1/001"]


def frame(tokens_y: int = 7, docs=DOCS) -> pl.DataFrame:
    rows = []
    for doc in docs:
        for r in range(K):
            for t in range(1, H + 1):
                y = tokens_y if t == H else 5
                rows.append(
                    {
                        "doc_id": doc,
                        "replicate": r,
                        "t": t,
                        "x_token": 5,
                        "y_token": y,
                        "mismatch": y != 5,
                        "tv_rollout": 0.25 if y != 5 else 0.0,
                        "tv_fixed": 0.0,
                        "x_eos": False,
                        "y_eos": False,
                        "n_prompt": 30,
                        "n_kept": 15,
                    }
                )
    return pl.DataFrame(rows, schema=TRAJECTORY_SCHEMA)


def metadata(action: str, model: str = "tiny-llama", **extra) -> dict:
    return {
        "model": {"name": model, "path": f"data/models/{model}"},
        "revision": None,
        "action": {"name": action, "selector": "snapkv", "budget": 0.5},
        "H": H,
        "K": {"study1": K},
        "seed": 1,
        "coupling": "shared-reference",
        "dtype": "float32",
        "device": "cpu",
        "n_documents": len(DOCS),
        **extra,
    }


def documents() -> pl.DataFrame:
    return pl.DataFrame({"doc_id": DOCS, "stratum": ["ruler-1024"] * 2, "cohort": ["study1"] * 2})


@pytest.fixture
def files(tmp_path):
    out = {}
    for action, y in (("snapkv-half", 7), ("recent-half", 5)):
        path = tmp_path / "trajectories" / action / "ruler-1024.parquet"
        write_trajectories(frame(y), path, metadata(action, vocab_size=512))
        out[action] = path
    return out


def test_files_in_their_roles_are_analysed(files):
    stats, _ = document_stats(
        {a: [p] for a, p in files.items()}, documents(), role={"model": "tiny-llama"}
    )
    assert stats.height == 4
    means = dict(zip(stats["action"], stats["mismatch"], strict=True))
    assert means == {"recent-half": 0.0, "snapkv-half": 1 / H}


def test_two_actions_files_swapped_under_each_others_names_stop_in_one_line(files, tmp_path):
    swapped = tmp_path / "swapped"
    a, b = (swapped / name / "ruler-1024.parquet" for name in ("snapkv-half", "recent-half"))
    for target, source in ((a, files["recent-half"]), (b, files["snapkv-half"])):
        target.parent.mkdir(parents=True)
        shutil.copy(source, target)
    with pytest.raises(AnalysisInputError) as info:
        document_stats({"snapkv-half": [a], "recent-half": [b]}, documents())
    assert one_line(info) == (
        f"{a}: its metadata says action 'recent-half', but it is read as the trajectory file of "
        "action 'snapkv-half'; expected the file written for action 'snapkv-half' (files "
        "swapped or copied under another name: rerun that job)"
    )


def test_another_models_file_stops_in_one_line(files):
    with pytest.raises(AnalysisInputError) as info:
        document_stats({a: [p] for a, p in files.items()}, documents(), role={"model": "tiny-qwen"})
    assert (
        "its metadata says model 'tiny-llama', but it is read as the trajectory file of model "
        in (one_line(info))
    )


def test_the_reader_checks_strata_and_cohorts_of_the_documents(files):
    path = files["snapkv-half"]
    with pytest.raises(TrajectoryFormatError) as info:
        read_trajectories(path, role={"action": "snapkv-half", "stratum": "helmet-1024"})
    assert one_line(info) == (
        f"{path}: holds documents of stratum 'ruler-1024', but it is read as the trajectory file "
        "of stratum helmet-1024; expected only its documents (files swapped or copied under "
        "another name: rerun that job)"
    )
    with pytest.raises(TrajectoryFormatError, match="holds documents of cohort 'study1'"):
        read_trajectories(path, role={"cohort": ["dev", "study2"]})
    read_trajectories(path, role={"action": "snapkv-half", "stratum": "ruler-1024"})


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path):
    path = tmp_path / "t.parquet"
    write_trajectories(frame(512), path, metadata("snapkv-half", vocab_size=512))
    with pytest.raises(TrajectoryFormatError) as info:
        read_trajectories(path)
    assert one_line(info) == (
        f"{path}: y_token holds token id 512; expected token ids below the model's vocab_size "
        "512 (the file's metadata)"
    )


def test_negative_token_ids_are_refused_in_any_file(tmp_path):
    path = tmp_path / "t.parquet"
    write_trajectories(frame(-3), path, metadata("snapkv-half"))
    with pytest.raises(TrajectoryFormatError) as info:
        read_trajectories(path)
    assert one_line(info) == f"{path}: y_token holds token id -3; expected token ids >= 0"


def test_a_document_stats_file_of_another_model_stops(tmp_path):
    clock = Clock.for_horizon(H)
    table = pl.DataFrame({"doc_id": DOCS, "action": ["a", "a"]})
    path = tmp_path / "document_stats.parquet"
    write_document_stats(table, path, clock, {"study": "study1", "model": "tiny-llama"})
    with pytest.raises(AnalysisInputError) as info:
        read_document_stats(path, {"study": "study1", "model": "tiny-qwen"})
    assert one_line(info) == (
        f"{path}: its metadata says model 'tiny-llama', but it is read as the document-stats "
        "file of model 'tiny-qwen'; expected the file written for model 'tiny-qwen' (files "
        "swapped or copied under another name: rerun that job)"
    )


def test_role_and_token_problems_are_exact():
    meta = metadata("a")
    assert role_problem("f", meta, {"action": "a", "model": "tiny-llama"}, DOCS) is None
    assert role_problem("f", {}, {"action": "b", "study": "s"}) is None  # nothing recorded
    assert token_ids_problem("f", "x", 0, 511, 512) is None
    assert token_ids_problem("f", "x", 0, 511, None) is None
    assert token_ids_problem("f", "x", 0, np.int64(2**40), None) is None
    with pytest.raises(ValueError, match="role 'doc'"):
        role_problem("f", meta, {"doc": "x"})
