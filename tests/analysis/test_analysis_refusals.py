"""Values the analysis cannot use stop it before any estimand, in one line naming the file, the
document, replicate and step (kvdiverge.analysis.document_stats)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from refusal_helpers import one_line

from kvdiverge.analysis.document_stats import AnalysisInputError, document_stats
from kvdiverge.analysis.synthetic import stratum_pairs, write_synthetic_study
from kvdiverge.io.trajectories import (
    read_trajectories,
    read_trajectory_metadata,
    write_trajectories,
)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    pairs = {"ruler-a": stratum_pairs(5, {"full": 0.0, "strong": 0.4})}
    cohorts = {"dev": (2, 3), "study1": (2, 3)}
    return write_synthetic_study(root, "study1", "m", pairs, cohorts, 8, 3, control="full")


def test_nan_delta_stops_the_analysis_before_any_estimand(synthetic, tmp_path):
    source = synthetic["strong"]["ruler-a"]
    frame = read_trajectories(source)
    bad = tmp_path / "strong.parquet"
    nan = frame.with_columns(
        tv_rollout=pl.when(pl.int_range(pl.len()) == 17).then(np.nan).otherwise("tv_rollout")
    )
    write_trajectories(nan, bad, read_trajectory_metadata(source))
    files = {"full": [synthetic["full"]["ruler-a"]], "strong": [bad]}
    with pytest.raises(AnalysisInputError) as info:
        document_stats(files, [synthetic["documents"]["ruler-a"]], control="full")
    row = frame.row(17, named=True)
    assert one_line(info) == (
        f"{bad}: doc_id {row['doc_id']!r} replicate {row['replicate']} step {row['t']}: "
        "tv_rollout (δ) = nan, expected a finite value in [0, 1]"
    )
