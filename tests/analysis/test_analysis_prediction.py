"""Aggregate prediction on a finite-state study with dev and eval cohorts."""

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


def _shuffle_unordered_joins(monkeypatch) -> None:
    """Make every DataFrame join that does not ask for an order return its rows shuffled.

    Without ``maintain_order`` polars promises no row order; a later version may reorder, so
    code that matches join results to rows by position must fail here."""
    original = pl.DataFrame.join
    rng = np.random.default_rng(0)

    def join(self, other, *args, **kwargs):
        out = original(self, other, *args, **kwargs)
        if kwargs.get("maintain_order") in (None, "none"):
            out = out[rng.permutation(out.height)]
        return out

    monkeypatch.setattr(pl.DataFrame, "join", join)


def test_cell_means_are_matched_to_rows_by_key(study, monkeypatch):
    stats, _ = study
    dev = stats.filter(pl.col("cohort") == "dev", pl.col("action").is_in(PAIR))
    test = stats.filter(pl.col("cohort") == "study1", pl.col("action").is_in(PAIR))
    test = test.sample(fraction=1.0, shuffle=True, seed=1)  # rows in no particular order
    # one test stratum unseen in training: its rows fall back to the action's mean
    test = test.with_columns(
        stratum=pl.when(pl.col("doc_id").str.ends_with("0"))
        .then(pl.lit("unseen"))
        .otherwise(pl.col("stratum"))
    )
    _shuffle_unordered_joins(monkeypatch)
    pred = _fit_predict("cell_mean", dev, test, [])
    cells = {
        (s, a): v
        for s, a, v in dev.group_by("stratum", "action").agg(pl.col("mismatch").mean()).iter_rows()
    }
    overall = {a: v for a, v in dev.group_by("action").agg(pl.col("mismatch").mean()).iter_rows()}
    expected = [
        cells.get((s, a), overall[a]) for s, a in zip(test["stratum"], test["action"], strict=True)
    ]
    assert "unseen" in set(test["stratum"])
    np.testing.assert_array_equal(pred, expected)


def test_prediction_table_does_not_depend_on_row_order(study, monkeypatch):
    """Shuffled input rows and order-free joins give the same table: documents are matched by
    key everywhere (cell means, document contrasts, uncalibrated gaps, bootstrap order)."""
    stats, clock = study
    kwargs = dict(model="m", pair=PAIR, eval_cohort="study1", draws=200, seed=3, folds=3)
    reference = prediction_table(stats, clock, **kwargs)
    _shuffle_unordered_joins(monkeypatch)
    shuffled = stats.sample(fraction=1.0, shuffle=True, seed=7)
    again = prediction_table(shuffled, clock, **kwargs)
    assert again.select("observation", "predictor", "quantity").equals(
        reference.select("observation", "predictor", "quantity")
    )
    for column in ("value", "ci_low", "ci_high"):
        np.testing.assert_allclose(
            again[column].to_numpy().astype(float),
            reference[column].to_numpy().astype(float),
            rtol=1e-12,
            atol=1e-15,
        )
    assert again["decision"].to_list() == reference["decision"].to_list()
