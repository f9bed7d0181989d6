"""Paired, stratified document bootstrap as a weights matrix (`docs/method.md`, "Uncertainty").

Documents are resampled with replacement within their strata; one draw is a vector of
multiplicities (a row of the weights matrix) applied to every action's statistics, so contrasts
are paired. A resampled document mean is then ``weights @ statistics / n`` for all draws and all
statistics at once.

Few documents: a unit (a cohort, a stratum, a model's rows) of one document has no interval
— every resample repeats it — so an interval from fewer than :data:`MIN_INTERVAL_DOCUMENTS`
documents is reported as not available; n documents of a stratum allow only
:func:`distinct_resamples` = C(2n − 1, n) different resamples (10 for 3), which the per-stratum
tables state by giving each row's documents.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "MIN_INTERVAL_DOCUMENTS",
    "MIN_TAIL_DRAWS",
    "bootstrap_draws_problem",
    "distinct_resamples",
    "min_draws",
    "percentile_interval",
    "resampled_means",
    "stratified_bootstrap_weights",
    "study_levels",
]

MIN_INTERVAL_DOCUMENTS = 2
"""The fewest documents an interval is reported from (module docstring)."""

MIN_TAIL_DRAWS = 50
"""The fewest bootstrap draws beyond each end of a percentile interval (:func:`min_draws`)."""


def min_draws(level: float, tail: int = MIN_TAIL_DRAWS) -> int:
    """The fewest bootstrap draws that put at least ``tail`` draws in each tail of a
    percentile interval at ``level``: the least B with B·(1 − level)/2 ≥ tail, i.e.
    ⌈2·tail/(1 − level)⌉ (2,000 at 95%, 16,000 at 99.375%), computed to a relative 1e-9 so
    that 1 − 0.05/8 in binary floating point does not ask for one draw more."""
    if not 0 < level < 1:
        raise ValueError(f"interval level: expected a value in (0, 1), got {level}")
    return math.ceil(2 * tail / (1 - level) * (1 - 1e-9))


def study_levels(config: Mapping[str, Any], study: str) -> list[float]:
    """The interval levels a study's tables use: ``analysis.level`` (pointwise), and
    1 − ``analysis.alpha``/m for a study with a family (``family_endpoints`` m > 1)."""
    analysis = config["analysis"]
    levels = [float(analysis["level"])]
    m = config["studies"][study].get("family_endpoints", 1)
    if m > 1:
        levels.append(1 - float(analysis["alpha"]) / m)
    return levels


def bootstrap_draws_problem(config: Mapping[str, Any]) -> str | None:
    """One line naming the first study whose ``bootstrap_draws`` put fewer than
    :data:`MIN_TAIL_DRAWS` draws in a tail of one of its intervals (:func:`study_levels`,
    :func:`min_draws`), with the draws needed; ``None`` when every study has enough."""
    for study, spec in config["studies"].items():
        draws = spec["bootstrap_draws"]
        for level in study_levels(config, study):
            needed = min_draws(level)
            if draws < needed:
                return (
                    f"config.studies.{study}.bootstrap_draws: {draws} draws put "
                    f"{draws * (1 - level) / 2:.3g} in each tail of its {100 * level:.6g}% "
                    f"intervals; expected at least {needed} (>= {MIN_TAIL_DRAWS} draws in each "
                    f"tail)"
                )
    return None


def distinct_resamples(sizes: Iterable[int]) -> int:
    """The number of different stratified resamples of strata of ``sizes`` documents: the
    multisets of n out of n, C(2n − 1, n) per stratum, multiplied."""
    return math.prod(math.comb(2 * n - 1, n) for n in sizes)


def stratified_bootstrap_weights(
    strata: Sequence[str] | np.ndarray, draws: int, seed: int | np.random.SeedSequence
) -> np.ndarray:
    """Multiplicities (draws, n_docs) of documents resampled with replacement within strata.

    Each row keeps every stratum's size: the multiplicities of a stratum's documents sum to its
    document count. Seeded and vectorized: one integer draw
    per (draw, document) and one ``bincount``.
    """
    labels = np.asarray(strata)
    n = labels.shape[0]
    if draws < 1:
        raise ValueError(f"bootstrap draws: expected at least 1, got {draws}")
    if n == 0:
        raise ValueError("bootstrap: no documents to resample")
    rng = np.random.default_rng(seed)
    order = np.argsort(labels, kind="stable")
    sorted_labels = labels[order]
    starts = np.flatnonzero(np.r_[True, sorted_labels[1:] != sorted_labels[:-1]])
    sizes = np.diff(np.r_[starts, n])
    size_of = np.repeat(sizes, sizes)  # per sorted slot: its stratum's size
    start_of = np.repeat(starts, sizes)
    picks = start_of + np.floor(rng.random((draws, n)) * size_of).astype(np.int64)
    picks = np.minimum(picks, start_of + size_of - 1)
    flat = (np.arange(draws)[:, None] * n + order[picks]).ravel()
    return np.bincount(flat, minlength=draws * n).reshape(draws, n).astype(np.float64)


def resampled_means(weights: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Document means of ``values`` (n_docs, n_stats) under each weight row (draws, n_docs).

    Row r is Σ_i w_ri x_i / Σ_i w_ri: a matrix product, so all draws and statistics at once.
    """
    w = np.asarray(weights, dtype=np.float64)
    return (w @ np.asarray(values, dtype=np.float64)) / w.sum(1, keepdims=True)


def percentile_interval(
    draws: np.ndarray, level: float | np.ndarray, axis: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap interval of each estimand; its draws run along ``axis``.

    ``draws`` is (n_draws, n_estimands) for ``axis=0`` or (n_estimands, n_draws) for ``axis=1``.
    ``level`` is the coverage (0.95 pointwise, 1 − α/m family-adjusted), scalar or per estimand.
    Quantiles follow numpy's default ("linear") definition. Draws where an estimand is undefined
    (NaN, e.g. a ratio with a zero denominator) are left out; an estimand with no finite draw
    gets a NaN interval. NaN-free estimands use a partial sort (``np.partition``).
    """
    x = np.asarray(draws, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None] if axis == 0 else x[None, :]
    rows = np.moveaxis(x, axis, -1)  # (n_estimands, n_draws), draws along the last axis
    n_est, n_draws = rows.shape
    levels = np.broadcast_to(np.asarray(level, dtype=np.float64), (n_est,))
    if ((levels <= 0) | (levels >= 1)).any():
        raise ValueError(f"interval level: expected values in (0, 1), got {level}")
    low = np.full(n_est, np.nan)
    high = np.full(n_est, np.nan)
    finite = np.isfinite(rows)
    complete = finite.all(1)

    def interpolate(ordered: np.ndarray, count: np.ndarray, p: np.ndarray) -> np.ndarray:
        pos = p * (count - 1)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, count - 1)
        idx = np.arange(ordered.shape[0])
        a, b = ordered[idx, lo], ordered[idx, hi]
        frac = pos - lo
        return np.where(frac == 0, a, a + (b - a) * frac)

    for lvl in np.unique(levels[complete]):
        sel = complete & (levels == lvl)
        p = np.array([(1 - lvl) / 2, (1 + lvl) / 2])
        pos = p * (n_draws - 1)
        kth = np.unique(np.clip(np.r_[np.floor(pos), np.floor(pos) + 1], 0, n_draws - 1))
        part = np.partition(rows[sel], kth.astype(np.int64), axis=1)
        count = np.full(part.shape[0], n_draws)
        low[sel] = interpolate(part, count, np.full(part.shape[0], p[0]))
        high[sel] = interpolate(part, count, np.full(part.shape[0], p[1]))
    partial = ~complete & finite.any(1)
    if partial.any():
        ordered = np.sort(rows[partial], axis=1)  # NaNs sort last
        count = finite[partial].sum(1)
        lv = levels[partial]
        low[partial] = interpolate(ordered, count, (1 - lv) / 2)
        high[partial] = interpolate(ordered, count, (1 + lv) / 2)
    return low, high
