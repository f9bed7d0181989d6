"""Aggregate prediction (SPEC §5, paper §5.7) on a finite-state study with dev and eval cohorts."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from kvdiverge.analysis.document_stats import AnalysisInputError, document_stats
from kvdiverge.analysis.estimands import estimands_table
from kvdiverge.analysis.prediction import (
    _fit_predict,
    equivalence_decision,
    prediction_table,
)
from kvdiverge.analysis.synthetic import stratum_pairs, write_synthetic_study

LAMBDAS = {"full": 0.0, "snap-512": 0.5, "snap-half": 0.15}
PAIR = ("snap-512", "snap-half")


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("prediction")
    strata = ["helmet-4k", "ruler-4k"]
    pairs = {s: stratum_pairs(50 + i, LAMBDAS) for i, s in enumerate(strata)}
    files = write_synthetic_study(
        root, "study1", "m", pairs, {"dev": (12, 8), "study1": (24, 8)}, H=32, seed=2
    )
    return document_stats(
        {a: list(files[a].values()) for a in LAMBDAS}, list(files["documents"].values())
    )


@pytest.mark.parametrize(
    "low, high, decision",
    [
        (-0.01, 0.015, "Equivalent"),
        (-0.02, 0.02, "Equivalent"),
        (-0.01, 0.03, "Unresolved"),
        (0.021, 0.05, "Not equivalent"),
        (-0.09, -0.03, "Not equivalent"),
    ],
)
def test_equivalence_decision(low, high, decision):
    assert equivalence_decision(low, high, 0.02) == decision


def test_cell_mean_on_its_own_training_cohort_has_zero_error(study):
    stats, _ = study
    dev = stats.filter(pl.col("cohort") == "dev", pl.col("action").is_in(PAIR)).sort(
        "stratum", "doc_id", "action"
    )
    pred = _fit_predict("cell_mean", dev, dev, [])
    wide = (
        dev.with_columns(pred=pred)
        .group_by("stratum", "action")
        .agg(pl.col("pred").mean() - pl.col("mismatch").mean())
    )
    np.testing.assert_allclose(wide["pred"], 0, atol=1e-14)


def test_prediction_table_rows_and_consistency(study):
    stats, clock = study
    table = prediction_table(
        stats, clock, model="m", pair=PAIR, eval_cohort="study1", draws=500, seed=3
    )
    for observation in ("positions_1_32", "fixed_history"):
        rows = table.filter(observation=observation)
        cv = rows.filter(quantity="cv_mse")
        assert set(cv["predictor"]) == {"cell_mean", "ridge"}
        chosen = cv.sort("value")["predictor"][0]
        value = dict(zip(rows["quantity"], rows["value"], strict=False))
        error = rows.filter(quantity="error").row(0, named=True)
        assert error["predictor"] == chosen
        assert error["value"] == pytest.approx(
            value["predicted_contrast"] - value["observed_contrast"]
        )
        assert error["ci_level"] == pytest.approx(1 - 0.05 / 4)
        assert error["ci_low"] <= error["value"] <= error["ci_high"]
        assert error["decision"] == equivalence_decision(error["ci_low"], error["ci_high"], 0.02)
        assert abs(error["value"]) <= value["mae"] <= value["rmse"]
    estimands = estimands_table(
        stats, clock, model="m", actions=list(PAIR), cohort="study1", draws=10, seed=0
    ).filter(stratum="pooled", contrast="snap-512 - snap-half")
    observed = table.filter(quantity="observed_contrast")["value"]
    expected = {
        "observed": estimands.filter(estimand="R_smc")["value"].item(),
        "full_rollout_tv_gap": estimands.filter(estimand="R")["value"].item(),
        "fixed_history_gap": estimands.filter(estimand="F")["value"].item(),
        "flat_extrapolation_gap": estimands.filter(estimand="flat_extrapolation")["value"].item(),
        "full_minus_fixed": estimands.filter(estimand="R_minus_F")["value"].item(),
        "full_minus_flat": estimands.filter(estimand="R_minus_flat")["value"].item(),
    }
    np.testing.assert_allclose(observed, expected.pop("observed"), rtol=1e-12)
    uncal = table.filter(observation="uncalibrated")
    for name, value in expected.items():
        assert uncal.filter(quantity=name)["value"].item() == pytest.approx(value, rel=1e-9)


def test_ridge_on_prefix_features_beats_a_constant_when_documents_differ(study):
    stats, _ = study
    dev = stats.filter(pl.col("cohort") == "dev", pl.col("action").is_in(PAIR))
    test = stats.filter(pl.col("cohort") == "study1", pl.col("action").is_in(PAIR))
    features = ["prefix_mismatch", "prefix_diverged", "prefix_x_eos", "prefix_y_eos"]
    ridge = _fit_predict("ridge", dev, test, features)
    cell = _fit_predict("cell_mean", dev, test, features)
    target = test["mismatch"].to_numpy()
    assert np.mean((ridge - target) ** 2) < np.mean((cell - target) ** 2)


def test_missing_action_and_empty_cohort_are_errors(study):
    stats, clock = study
    partial = stats.filter(
        ~((pl.col("action") == "snap-half") & pl.col("doc_id").str.ends_with("003"))
    )
    with pytest.raises(AnalysisInputError, match="lacks one of the actions"):
        prediction_table(partial, clock, model="m", pair=PAIR, eval_cohort="study1", draws=10)
    with pytest.raises(AnalysisInputError, match="cohort 'study2' has no documents"):
        prediction_table(stats, clock, model="m", pair=PAIR, eval_cohort="study2", draws=10)
