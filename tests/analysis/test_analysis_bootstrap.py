"""Paired stratified document bootstrap (`docs/method.md`, "Uncertainty")."""

from __future__ import annotations

import numpy as np
import pytest

from kvdiverge.analysis.bootstrap import (
    percentile_interval,
    resampled_means,
    stratified_bootstrap_weights,
)

STRATA = np.array(["b"] * 5 + ["a"] * 3 + ["c"] * 7 + ["a"] * 2)


def test_weights_keep_every_stratum_size_and_only_resample_within():
    w = stratified_bootstrap_weights(STRATA, 500, 1)
    assert w.shape == (500, STRATA.size)
    for s in np.unique(STRATA):
        members = STRATA == s
        np.testing.assert_array_equal(w[:, members].sum(1), members.sum())
    assert (w >= 0).all() and np.array_equal(w, np.round(w))
    # each document is drawn with probability 1/n_s per slot: mean multiplicity 1
    w_big = stratified_bootstrap_weights(STRATA, 40_000, 2)
    np.testing.assert_allclose(w_big.mean(0), 1.0, atol=0.03)
    # a single-document stratum is always kept exactly once
    single = stratified_bootstrap_weights(np.array(["x", "y", "y"]), 100, 3)
    assert (single[:, 0] == 1).all()


def test_weights_are_seeded():
    a = stratified_bootstrap_weights(STRATA, 50, 7)
    assert np.array_equal(a, stratified_bootstrap_weights(STRATA, 50, 7))
    assert not np.array_equal(a, stratified_bootstrap_weights(STRATA, 50, 8))


def test_multiplicities_follow_the_multinomial_law():
    # stratum of 3 documents: P(a document is drawn k times) = C(3,k)(1/3)^k(2/3)^(3-k)
    w = stratified_bootstrap_weights(np.array(["s"] * 3), 60_000, 4)[:, 0]
    law = np.array([8, 12, 6, 1]) / 27
    freq = np.bincount(w.astype(int), minlength=4) / w.size
    np.testing.assert_allclose(freq, law, atol=0.01)


def test_resampled_means_are_weighted_document_means():
    rng = np.random.default_rng(0)
    values = rng.random((STRATA.size, 3))
    w = stratified_bootstrap_weights(STRATA, 20, 5)
    got = resampled_means(w, values)
    for r in range(20):
        picked = np.repeat(values, w[r].astype(int), axis=0)
        np.testing.assert_allclose(got[r], picked.mean(0), rtol=1e-12)


def test_percentile_interval_matches_numpy_and_skips_nan():
    rng = np.random.default_rng(1)
    draws = rng.normal(size=(1001, 4))
    low, high = percentile_interval(draws, 0.9)
    np.testing.assert_allclose(low, np.quantile(draws, 0.05, axis=0), rtol=1e-12)
    np.testing.assert_allclose(high, np.quantile(draws, 0.95, axis=0), rtol=1e-12)
    draws[::3, 1] = np.nan
    draws[:, 2] = np.nan
    low, high = percentile_interval(draws, [0.9, 0.9, 0.9, 1 - 0.05 / 8])
    np.testing.assert_allclose(low[1], np.nanquantile(draws[:, 1], 0.05), rtol=1e-12)
    assert np.isnan(low[2]) and np.isnan(high[2])
    np.testing.assert_allclose(high[3], np.quantile(draws[:, 3], 1 - 0.05 / 16), rtol=1e-12)
    with pytest.raises(ValueError, match="interval level"):
        percentile_interval(draws, 1.0)


def test_identical_actions_pair_to_a_zero_width_contrast():
    rng = np.random.default_rng(2)
    x = rng.random(STRATA.size)
    w = stratified_bootstrap_weights(STRATA, 300, 6)
    diff = resampled_means(w, x[:, None]) - resampled_means(w, x[:, None])
    low, high = percentile_interval(diff, 0.95)
    assert low[0] == 0 and high[0] == 0


def test_interval_coverage_is_nominal():
    """95% intervals of a stratified mean and a ratio of means cover the truth 92–98% of the time.

    Two strata of 48 documents (a paper stratum) with different laws; the pooled estimand weighs
    documents equally, so its truth is the size-weighted mix of the stratum expectations.
    """
    reps, draws = 1000, 999
    sizes = {"s1": 48, "s2": 48}
    strata = np.repeat(list(sizes), list(sizes.values()))
    n = strata.size
    s1 = strata == "s1"
    # numerator ~ Beta(2, 5) in s1 (mean 2/7), Exp(mean 0.5) in s2; denominator U(0.5, 1.5)+I[s2]
    mean_num = (48 * 2 / 7 + 48 * 0.5) / n
    mean_den = (48 * 1.0 + 48 * 2.0) / n
    truth = np.array([mean_num, mean_num / mean_den])
    rng = np.random.default_rng(11)
    hits = np.zeros(2)
    for r in range(reps):
        num = np.where(s1, rng.beta(2, 5, n), rng.exponential(0.5, n))
        den = rng.uniform(0.5, 1.5, n) + ~s1
        w = stratified_bootstrap_weights(strata, draws, [11, r])
        means = resampled_means(w, np.column_stack([num, den]))
        est = np.column_stack([means[:, 0], means[:, 0] / means[:, 1]])
        low, high = percentile_interval(est, 0.95)
        hits += (low <= truth) & (truth <= high)
    coverage = hits / reps
    assert ((coverage >= 0.92) & (coverage <= 0.98)).all(), coverage
