"""Aggregate prediction of the population-average contrast (Tables 3–4).

Documented in `docs/method.md`, "Aggregate prediction".

Per document and action, the target is the replicate-averaged token-mismatch fraction D_H.
Two observations predict it:

* ``positions_1_32``: ((1/H) Σ_{t≤m} I_t, 1{τ≤m}, 1{e_X≤m}, 1{e_Y≤m}) averaged over replicates,
  m = the clock's prefix (32 at H = 128);
* ``fixed_history``: the fixed-history (teacher-forced) TVs: F = (1/H) Σ_t f_t, the prefix
  mean of f_t and 1{e_X ≤ m} (the reference path's own EOS, observable without rollouts of Q).

Candidates per observation: ``cell_mean`` (training mean by stratum × action) and ``ridge``
(scikit-learn ridge on the observation's features plus stratum and action indicators, penalty
chosen by internal cross-validation). The candidate with the lower cross-validated document-
contrast mean squared error on the development cohort (folds grouped by document) is selected,
refitted on all development documents and applied to the evaluation cohort. Reported: the error
of the predicted population-average contrast (document-equal weights) with a paired stratified
bootstrap interval at 1 − α/4, the decision against ±margin, document-contrast MAE and RMSE,
and the uncalibrated contrasts of Table 4.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from kvdiverge.analysis.bootstrap import (
    percentile_interval,
    resampled_means,
    stratified_bootstrap_weights,
)
from kvdiverge.analysis.document_stats import AnalysisInputError, Clock

__all__ = [
    "OBSERVATIONS",
    "PREDICTION_COLUMNS",
    "equivalence_decision",
    "prediction_table",
]

OBSERVATIONS = {
    "positions_1_32": ["prefix_mismatch", "prefix_diverged", "prefix_x_eos", "prefix_y_eos"],
    "fixed_history": ["fixed_tv", "prefix_fixed", "prefix_x_eos"],
}
PREDICTION_COLUMNS = (
    "model",
    "observation",
    "predictor",
    "contrast",
    "quantity",
    "value",
    "ci_low",
    "ci_high",
    "ci_level",
    "decision",
    "n_docs",
)
_ALPHAS = np.logspace(-4, 3, 15)


def equivalence_decision(ci_low: float, ci_high: float, margin: float) -> str:
    """The decision: "Equivalent" iff the interval lies inside ±margin; "Not equivalent" iff it
    lies wholly outside; otherwise "Unresolved"."""
    if -margin <= ci_low and ci_high <= margin:
        return "Equivalent"
    if ci_low > margin or ci_high < -margin:
        return "Not equivalent"
    return "Unresolved"


def _fit_predict(
    predictor: str, train: pl.DataFrame, test: pl.DataFrame, features: list[str]
) -> np.ndarray:
    """Predicted D_H for ``test`` rows from a candidate fitted on ``train``, in the row order
    of ``test`` (the cell means are joined by key, keeping the order of ``test``)."""
    if predictor == "cell_mean":
        cells = train.group_by("stratum", "action").agg(pl.col("mismatch").mean().alias("pred"))
        overall = train.group_by("action").agg(pl.col("mismatch").mean().alias("fallback"))
        out = (
            test.select("stratum", "action")
            .join(
                cells,
                on=["stratum", "action"],
                how="left",
                validate="m:1",
                maintain_order="left",
            )
            .join(overall, on="action", how="left", validate="m:1", maintain_order="left")
        )
        return out.select(pl.coalesce("pred", "fallback")).to_series().to_numpy()
    strata = sorted(set(train["stratum"]))
    actions = sorted(set(train["action"]))

    def design(frame: pl.DataFrame) -> np.ndarray:
        indicators = [
            (frame[col].to_numpy() == level).astype(np.float64)
            for col, levels in (("stratum", strata), ("action", actions))
            for level in levels
        ]
        numeric = frame.select(features).to_numpy().astype(np.float64)
        return np.column_stack([numeric, *indicators])

    # scikit-learn is imported where a ridge is fitted: the modules that read PREDICTION_COLUMNS
    # (kvdiverge.tables.inputs, so every table job) do not load it
    from sklearn.compose import ColumnTransformer
    from sklearn.linear_model import RidgeCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    n_numeric = len(features)
    model = make_pipeline(
        ColumnTransformer(
            [("obs", StandardScaler(), list(range(n_numeric)))], remainder="passthrough"
        ),
        RidgeCV(alphas=_ALPHAS),
    )
    model.fit(design(train), train["mismatch"].to_numpy())
    return model.predict(design(test))


def _document_contrasts(
    frame: pl.DataFrame, predicted: np.ndarray, pair: tuple[str, str]
) -> pl.DataFrame:
    """Per document: predicted and observed contrast b − a (rows sorted by stratum, doc_id).

    ``predicted`` follows the row order of ``frame``; documents are then matched by key.
    """
    b, a = pair
    rows = frame.select("doc_id", "stratum", "action", "mismatch").with_columns(pred=predicted)
    wide = rows.pivot(on="action", index=["doc_id", "stratum"], values=["mismatch", "pred"])
    return wide.select(
        "doc_id",
        "stratum",
        observed=pl.col(f"mismatch_{b}") - pl.col(f"mismatch_{a}"),
        predicted=pl.col(f"pred_{b}") - pl.col(f"pred_{a}"),
    ).sort("stratum", "doc_id")


def _cv_contrast_mse(
    predictor: str, dev: pl.DataFrame, features: list[str], pair: tuple[str, str], folds: int
) -> float:
    docs = dev["doc_id"].unique().sort()
    n_splits = min(folds, docs.len())
    if n_splits < 2:
        raise AnalysisInputError("prediction: the development cohort needs at least 2 documents")
    from sklearn.model_selection import GroupKFold

    groups = dev["doc_id"].to_numpy()
    errors = []
    for train_idx, test_idx in GroupKFold(n_splits=n_splits).split(dev, groups=groups):
        train, test = dev[train_idx], dev[test_idx]
        contrast = _document_contrasts(test, _fit_predict(predictor, train, test, features), pair)
        errors.append((contrast["predicted"] - contrast["observed"]).to_numpy())
    return float(np.mean(np.concatenate(errors) ** 2))


def _select_rows(stats: pl.DataFrame, cohort: str, pair: tuple[str, str], where: str):
    rows = stats.filter(pl.col("cohort") == cohort, pl.col("action").is_in(list(pair)))
    if rows.height == 0:
        raise AnalysisInputError(f"{where}: cohort {cohort!r} has no documents for {pair}")
    counts = rows.group_by("doc_id").len()
    if (counts["len"] != 2).any():
        doc = counts.filter(pl.col("len") != 2)["doc_id"][0]
        raise AnalysisInputError(f"{where}: document {doc!r} lacks one of the actions {pair}")
    return rows.sort("stratum", "doc_id", "action")


def prediction_table(
    stats: pl.DataFrame,
    clock: Clock,
    *,
    model: str,
    pair: tuple[str, str],
    dev_cohort: str = "dev",
    eval_cohort: str,
    draws: int = 10_000,
    seed: int = 0,
    alpha: float = 0.05,
    comparisons: int = 4,
    margin: float = 0.02,
    level: float = 0.95,
    folds: int = 5,
    where: str = "document stats",
) -> pl.DataFrame:
    """Table 3 and Table 4 of the paper for one model, in long format (PREDICTION_COLUMNS).

    ``pair = (b, a)`` names the contrast b − a (SnapKV-512 − SnapKV-half in the paper). For
    each observation: ``cv_mse_<candidate>`` rows (development), then for the selected
    predictor ``predicted_contrast``, ``observed_contrast``, ``error`` (interval at
    1 − alpha/comparisons, with the decision against ±margin), ``mae`` and ``rmse`` of the
    document contrasts. Uncalibrated rows (observation ``uncalibrated``, pointwise ``level``):
    ``full_rollout_tv_gap``, ``fixed_history_gap``, ``flat_extrapolation_gap``,
    ``full_minus_fixed``, ``full_minus_flat``.
    """
    dev = _select_rows(stats, dev_cohort, pair, where)
    test = _select_rows(stats, eval_cohort, pair, where)
    contrast_label = f"{pair[0]} - {pair[1]}"
    # the bootstrap's document order; every per-document vector is joined onto it by doc_id
    test_docs = test.filter(pl.col("action") == pair[0]).select("doc_id", "stratum")
    test_docs = test_docs.sort("stratum", "doc_id")
    weights = stratified_bootstrap_weights(
        test_docs["stratum"].to_numpy(), draws, np.random.SeedSequence(seed)
    )
    adjusted = 1 - alpha / comparisons
    rows: list[dict] = []

    def add(observation, predictor, quantity, value, low=None, high=None, lvl=None, decision=""):
        rows.append(
            {
                "model": model,
                "observation": observation,
                "predictor": predictor,
                "contrast": contrast_label,
                "quantity": quantity,
                "value": float(value),
                "ci_low": None if low is None else float(low),
                "ci_high": None if high is None else float(high),
                "ci_level": lvl,
                "decision": decision,
                "n_docs": test_docs.height if quantity not in ("cv_mse",) else None,
            }
        )

    for observation, features in OBSERVATIONS.items():
        cv = {p: _cv_contrast_mse(p, dev, features, pair, folds) for p in ("cell_mean", "ridge")}
        for p, mse in cv.items():
            rows.append(
                {
                    "model": model,
                    "observation": observation,
                    "predictor": p,
                    "contrast": contrast_label,
                    "quantity": "cv_mse",
                    "value": mse,
                    "ci_low": None,
                    "ci_high": None,
                    "ci_level": None,
                    "decision": "",
                    "n_docs": dev["doc_id"].n_unique(),
                }
            )
        chosen = min(cv, key=cv.get)
        contrast = _document_contrasts(test, _fit_predict(chosen, dev, test, features), pair)
        contrast = test_docs.join(
            contrast, on=["doc_id", "stratum"], how="left", validate="1:1", maintain_order="left"
        )
        diff = (contrast["predicted"] - contrast["observed"]).to_numpy()
        boot = resampled_means(weights, diff[:, None])
        low, high = percentile_interval(boot, adjusted)
        add(observation, chosen, "predicted_contrast", contrast["predicted"].mean())
        add(observation, chosen, "observed_contrast", contrast["observed"].mean())
        add(
            observation,
            chosen,
            "error",
            diff.mean(),
            low[0],
            high[0],
            adjusted,
            equivalence_decision(low[0], high[0], margin),
        )
        add(observation, chosen, "mae", np.abs(diff).mean())
        add(observation, chosen, "rmse", np.sqrt((diff**2).mean()))

    def gap(expr: pl.Expr) -> np.ndarray:
        """Per document (in the order of ``test_docs``): ``expr`` for b minus ``expr`` for a."""
        sides = [
            test.filter(pl.col("action") == action).select("doc_id", value=expr) for action in pair
        ]
        joined = test_docs.join(
            sides[0], on="doc_id", how="left", validate="1:1", maintain_order="left"
        ).join(
            sides[1],
            on="doc_id",
            how="left",
            suffix="_a",
            validate="1:1",
            maintain_order="left",
        )
        return (joined["value"] - joined["value_a"]).to_numpy()

    flat = pl.col("prefix_mismatch") * clock.H / clock.prefix
    uncalibrated = {
        "full_rollout_tv_gap": gap(pl.col("rollout_tv")),
        "fixed_history_gap": gap(pl.col("fixed_tv")),
        "flat_extrapolation_gap": gap(flat),
        "full_minus_fixed": gap(pl.col("rollout_tv") - pl.col("fixed_tv")),
        "full_minus_flat": gap(pl.col("rollout_tv") - flat),
    }
    values = np.column_stack(list(uncalibrated.values()))
    low, high = percentile_interval(resampled_means(weights, values), level)
    for i, name in enumerate(uncalibrated):
        add("uncalibrated", "", name, values[:, i].mean(), low[i], high[i], level)
    return pl.DataFrame(rows, schema_overrides={"ci_level": pl.Float64, "n_docs": pl.Int64})


def prediction_tables(frames: Sequence[pl.DataFrame]) -> pl.DataFrame:
    """Concatenate per-model prediction tables in the PREDICTION_COLUMNS order."""
    return pl.concat([f.select(PREDICTION_COLUMNS) for f in frames])
