"""The full-retention control check (SPEC §5): δ ≡ 0 and X ≡ Y, else a loud error naming the
document."""

from __future__ import annotations

import polars as pl
import pytest

from kvdiverge.analysis.control import (
    ControlCheckError,
    check_full_retention_control,
    control_violations,
)
from kvdiverge.analysis.document_stats import document_stats
from kvdiverge.analysis.synthetic import stratum_pairs, write_synthetic_study
from kvdiverge.trajectories import read_trajectories, read_trajectory_metadata, write_trajectories

LAMBDAS = {"full": 0.0, "strong": 0.6}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("control")
    pairs = {"ruler-a": stratum_pairs(5, LAMBDAS)}
    files = write_synthetic_study(
        root, "study1", "m", pairs, {"dev": (2, 4), "study1": (3, 4)}, H=16, seed=3, control="full"
    )
    return files


def _tamper(path, out, **change):
    frame = read_trajectories(path)
    row = (pl.col("doc_id") == frame["doc_id"][3]) & (pl.col("replicate") == 1) & (pl.col("t") == 5)
    frame = frame.with_columns(
        [pl.when(row).then(pl.lit(v)).otherwise(pl.col(k)).alias(k) for k, v in change.items()]
    )
    write_trajectories(frame, out, read_trajectory_metadata(path))
    return frame["doc_id"][3]


def test_clean_control_passes(study):
    paths = list(study["full"].values())
    check_full_retention_control(paths)
    assert control_violations(read_trajectories(paths[0])).height == 0


@pytest.mark.parametrize(
    "change",
    [
        {"tv_rollout": 1e-6},
        {"tv_fixed": 0.25},
        {"y_token": 999, "mismatch": True},
        {"y_token": 999},
    ],
)
def test_tampered_control_fails_naming_document(study, tmp_path, change):
    path = list(study["full"].values())[0]
    bad = tmp_path / "full.parquet"
    doc = _tamper(path, bad, **change)
    with pytest.raises(ControlCheckError) as info:
        check_full_retention_control([bad])
    msg = str(info.value)
    assert str(bad) in msg and repr(doc) in msg and "step 5" in msg and "replicate 1" in msg
    assert "\n" not in msg


def test_document_stats_runs_the_control_check(study, tmp_path):
    path = list(study["full"].values())[0]
    bad = tmp_path / "full.parquet"
    _tamper(path, bad, tv_rollout=0.5)
    files = {"full": [bad], "strong": list(study["strong"].values())}
    with pytest.raises(ControlCheckError, match="full-retention control failed"):
        document_stats(files, list(study["documents"].values()), control="full")
    ok = {"full": list(study["full"].values()), "strong": files["strong"]}
    stats, _ = document_stats(ok, list(study["documents"].values()), control="full")
    assert set(stats["action"]) == {"full", "strong"}
