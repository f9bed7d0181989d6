"""How sure the sample-size plan is of itself, and how it fared (`docs/method.md`, "Sample-size
planning").

The plan (:mod:`kvdiverge.analysis.planning`) predicts each entry's half-width from σ_b² and
σ_w², estimated from a handful of development documents. Those estimates are uncertain, and so
is the prediction. :func:`variance_draws` repeats the method of moments of
:func:`kvdiverge.analysis.planning.variance_components` under a stratified bootstrap of the
development documents (each draw resamples the documents within their strata, with the same
per-path values: the linearisation of a ratio keeps the development estimate θ), and
:func:`half_width_spread` turns the draws into a percentile interval of σ_b², σ_w² and of the
predicted half-width at the evaluation design (K, n). The interval says how far the development
stage alone can be trusted; it is no coverage statement about the evaluation.

After the evaluation, :func:`predicted_vs_achieved` sets each planned entry's predicted
half-width beside the half-width (ci_high − ci_low)/2 its pooled row of ``estimands.csv``
achieved, at the row's own level (a prediction made at another level is rescaled by the ratio
of the two normal quantiles, and the table says so).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl
from scipy.stats import norm

__all__ = [
    "PLAN_DRAWS",
    "PLAN_LEVEL",
    "half_width_spread",
    "predicted_vs_achieved",
    "render_plan_check",
    "variance_draws",
]

PLAN_DRAWS = 2000
"""Bootstrap draws of the development documents behind each entry's interval."""

PLAN_LEVEL = 0.9
"""Level of the intervals of σ_b², σ_w² and the predicted half-width."""


def _strata_weights(strata: np.ndarray, draws: int, seed: int) -> np.ndarray:
    """Multiplicities (draws, n_docs): documents resampled with replacement within strata."""
    rng = np.random.default_rng(seed)
    w = np.zeros((draws, strata.size))
    for stratum in np.unique(strata):
        members = np.flatnonzero(strata == stratum)
        picks = rng.integers(0, members.size, size=(draws, members.size))
        for j in range(members.size):
            w[:, members[j]] = (picks == j).sum(1)
    return w


def variance_draws(moments: pl.DataFrame, weights: np.ndarray) -> dict[str, np.ndarray]:
    """σ_b² (clipped at 0), its unclipped moment estimate, σ_w² and K_dev under each row of
    ``weights`` (draws, n_docs) over the documents of ``moments`` (one row per development
    document: ``n_paths``, ``value``, ``value_sq``, ``stratum``, in that order).

    With every weight 1 the result is :func:`kvdiverge.analysis.planning.variance_components`
    exactly: σ_w² = the mean over documents of the within-document variance (divisor k − 1),
    σ_b² = Σ (mean − stratum mean)² / (n − strata) − σ_w²/K_dev, each sum weighted by the
    documents' multiplicities.
    """
    k = moments["n_paths"].to_numpy().astype(np.float64)
    x = moments["value"].to_numpy().astype(np.float64)
    spread = moments["value_sq"].to_numpy() - x**2
    within = np.clip(np.where(k > 1, spread * k / np.maximum(k - 1, 1), 0.0), 0, None)
    strata = moments["stratum"].to_numpy()
    w = np.asarray(weights, dtype=np.float64)
    n = w.sum(1)
    sigma_w2 = w @ within / n
    k_dev = w @ k / n
    centred = np.zeros_like(w)
    for stratum in np.unique(strata):
        cols = strata == stratum
        mean = (w[:, cols] @ x[cols]) / w[:, cols].sum(1)
        centred[:, cols] = x[cols][None, :] - mean[:, None]
    dof = n - np.unique(strata).size
    var_means = (w * centred**2).sum(1) / dof
    raw = var_means - sigma_w2 / k_dev
    return {
        "sigma_between2": np.maximum(raw, 0.0),
        "sigma_between2_moment": raw,
        "sigma_within2": sigma_w2,
        "K_dev": k_dev,
    }


def _seed(*names: str) -> int:
    return zlib.crc32("\x1f".join(names).encode())


def half_width_spread(
    moments: pl.DataFrame,
    K: int,
    n_docs: int,
    level: float,
    names: Sequence[str] = (),
    draws: int = PLAN_DRAWS,
    interval_level: float = PLAN_LEVEL,
) -> dict[str, Any]:
    """The development stage's uncertainty about one entry (module docstring): the moment
    estimate of σ_b² before clipping and whether it was clipped, and ``interval_level``
    percentile intervals over ``draws`` stratified bootstrap draws of the development
    documents of σ_b², σ_w² and of the predicted half-width z·sqrt((σ_b² + σ_w²/K)/n) at
    ``level`` with ``n_docs`` documents. ``names`` (model, action, estimand) seed the draws,
    so the same development files give the same intervals."""
    seed = _seed("plan", *names)
    strata = moments["stratum"].to_numpy()
    observed = variance_draws(moments, np.ones((1, moments.height)))
    boot = variance_draws(moments, _strata_weights(strata, draws, seed))
    z = float(norm.ppf(0.5 + level / 2))
    hw = z * np.sqrt((boot["sigma_between2"] + boot["sigma_within2"] / K) / n_docs)
    q = [(1 - interval_level) / 2, (1 + interval_level) / 2]

    def interval(values: np.ndarray) -> list[float]:
        return [float(v) for v in np.quantile(values, q)]

    return {
        "sigma_between2_moment": float(observed["sigma_between2_moment"][0]),
        "sigma_between2_clipped": bool(observed["sigma_between2_moment"][0] < 0),
        "interval_level": interval_level,
        "draws": draws,
        "sigma_between2_interval": interval(boot["sigma_between2"]),
        "sigma_within2_interval": interval(boot["sigma_within2"]),
        "half_width_interval": interval(hw),
    }


PLAN_CHECK_COLUMNS = (
    "model",
    "action",
    "estimand",
    "level",
    "K",
    "n_docs",
    "predicted",
    "predicted_low",
    "predicted_high",
    "achieved",
    "ratio",
    "within",
)


def predicted_vs_achieved(plan: Mapping[str, Any], table: pl.DataFrame) -> pl.DataFrame:
    """Per entry of a locked ``plan``: its predicted half-width at the evaluation design
    (``evaluation.half_width``, with the development interval ``half_width_interval`` where the
    plan has one) beside the half-width its pooled row of the estimands ``table`` achieved,
    ``ratio`` = achieved / predicted and ``within`` (the achieved half-width inside the
    development interval). Predictions are rescaled to each row's ``ci_level`` by
    z(ci_level)/z(plan level). A row without an interval achieves NaN."""
    z_plan = float(norm.ppf(0.5 + float(plan["level"]) / 2))
    pooled = table.filter(
        (pl.col("stratum") == "pooled") & (pl.col("contrast").fill_null("") == "")
    )
    rows = []
    for e in plan["plans"]:
        found = pooled.filter(
            (pl.col("model") == e["model"])
            & (pl.col("action") == e["action"])
            & (pl.col("estimand") == e["estimand"])
        )
        evaluation = e["evaluation"]
        level = float(found["ci_level"][0]) if found.height else float(plan["level"])
        scale = float(norm.ppf(0.5 + level / 2)) / z_plan
        low, high = evaluation.get("half_width_interval") or [np.nan, np.nan]
        achieved = float(found["ci_high"][0] - found["ci_low"][0]) / 2 if found.height else np.nan
        predicted = evaluation["half_width"] * scale
        rows.append(
            {
                "model": e["model"],
                "action": e["action"],
                "estimand": e["estimand"],
                "level": level,
                "K": evaluation["K"],
                "n_docs": evaluation["n_docs"],
                "predicted": predicted,
                "predicted_low": low * scale,
                "predicted_high": high * scale,
                "achieved": achieved,
                "ratio": achieved / predicted if predicted > 0 else np.nan,
                "within": bool(low * scale <= achieved <= high * scale),
            }
        )
    return pl.DataFrame(rows, schema_overrides={"level": pl.Float64}).select(PLAN_CHECK_COLUMNS)


def render_plan_check(check: pl.DataFrame, interval_level: float = PLAN_LEVEL) -> str:
    """A Markdown rendering of :func:`predicted_vs_achieved`'s table."""
    lines = [
        f"Predicted versus achieved half-widths of the locked plan's entries (pooled rows); "
        f"the predicted interval is the development stage's {100 * interval_level:g}% "
        f"bootstrap interval.",
        "",
        "| model | action | estimand | level | K | documents | predicted | development "
        "interval | achieved | achieved / predicted | inside |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(x: float) -> str:
        return "NA" if x is None or not np.isfinite(x) else f"{x:.4f}"

    def ratio(x: float) -> str:
        return "NA" if x is None or not np.isfinite(x) else f"{x:.2f}x"

    for r in check.iter_rows(named=True):
        lines.append(
            f"| {r['model']} | {r['action']} | {r['estimand']} | {r['level']:.6g} | {r['K']} | "
            f"{r['n_docs']} | {fmt(r['predicted'])} | [{fmt(r['predicted_low'])}, "
            f"{fmt(r['predicted_high'])}] | {fmt(r['achieved'])} | "
            f"{ratio(r['ratio'])} | "
            f"{'yes' if r['within'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"
