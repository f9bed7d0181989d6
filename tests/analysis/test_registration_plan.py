"""Planning that tells the truth about itself (docs/method.md, "Sample-size planning"): the
development stage's uncertainty about each predicted half-width, and the predicted half-widths
beside the achieved ones."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
from scipy.stats import norm

from kvdiverge.analysis.plan_precision import (
    half_width_spread,
    predicted_vs_achieved,
    render_plan_check,
    variance_draws,
)
from kvdiverge.analysis.planning import variance_components


def _moments(sigma_b: float, sigma_w: float, n_docs: int, K: int, seed: int) -> pl.DataFrame:
    """Development documents of two strata: per document K paths of mean μ_i ~ N(0, σ_b²),
    path values μ_i + N(0, σ_w²); their replicate means of the values and their squares."""
    rng = np.random.default_rng(seed)
    mu = rng.normal(0, sigma_b, n_docs)
    values = mu[:, None] + rng.normal(0, sigma_w, (n_docs, K))
    return pl.DataFrame(
        {
            "doc_id": [f"d{i:03d}" for i in range(n_docs)],
            "stratum": ["a" if i % 2 else "b" for i in range(n_docs)],
            "n_paths": np.full(n_docs, K),
            "value": values.mean(1),
            "value_sq": (values**2).mean(1),
        }
    ).select("n_paths", "value", "value_sq", "stratum", "doc_id")


def test_with_every_weight_one_the_draws_are_the_plans_own_estimates():
    stats = _moments(0.3, 0.5, 12, 3, seed=1)
    plan = variance_components(stats, column="value")
    draw = variance_draws(stats, np.ones((1, stats.height)))
    assert draw["sigma_within2"][0] == pytest.approx(plan["sigma_within2"], rel=1e-12)
    assert draw["sigma_between2"][0] == pytest.approx(plan["sigma_between2"], rel=1e-12)
    assert draw["K_dev"][0] == plan["K_dev"] == 3
    # a weight of 2 is the document listed twice
    twice = pl.concat([stats, stats[:1]])
    w = np.ones((1, stats.height))
    w[0, 0] = 2
    assert variance_draws(stats, w)["sigma_within2"][0] == pytest.approx(
        variance_components(twice, column="value")["sigma_within2"], rel=1e-12
    )


def test_the_clipped_between_variance_is_said_and_the_interval_covers_the_truth():
    """σ_b = 0: the moment estimate is negative about half the time and clipped; the entry
    says so. Over many development samples from a known population, the 90% interval of the
    predicted half-width covers the half-width the true σ² give in most of them (a bootstrap
    of 24 documents: roughly, not exactly, 90%)."""
    K, n_eval, level = 4, 48, 0.95
    z = float(norm.ppf(0.5 + level / 2))
    truth = z * math.sqrt((0.2**2 + 0.6**2 / K) / n_eval)
    covered, clipped = 0, 0
    for seed in range(60):
        stats = _moments(0.2, 0.6, 24, 2, seed=seed)
        spread = half_width_spread(stats, K, n_eval, level, ("m", "a", str(seed)), draws=400)
        low, high = spread["half_width_interval"]
        covered += low <= truth <= high
        clipped += spread["sigma_between2_clipped"]
        assert spread["sigma_between2_clipped"] == (spread["sigma_between2_moment"] < 0)
        lo_b, hi_b = spread["sigma_between2_interval"]
        assert 0 <= lo_b <= hi_b
    assert covered >= 0.75 * 60
    stats = _moments(0.0, 0.6, 24, 2, seed=3)
    flat = [half_width_spread(_moments(0.0, 0.6, 24, 2, s), K, n_eval, level) for s in range(20)]
    assert sum(f["sigma_between2_clipped"] for f in flat) >= 3  # σ_b = 0: often clipped
    # seeded by the entry's names: the same development files, the same interval
    a = half_width_spread(stats, K, n_eval, level, ("m", "a", "S_99"))
    assert a == half_width_spread(stats, K, n_eval, level, ("m", "a", "S_99"))


def test_predicted_versus_achieved_reads_the_pooled_rows_at_their_level():
    plan = {
        "level": 0.95,
        "plans": [
            {
                "model": "m",
                "action": "a",
                "estimand": "R_smc",
                "evaluation": {
                    "K": 4,
                    "n_docs": 48,
                    "half_width": 0.02,
                    "half_width_interval": [0.01, 0.03],
                },
            },
            {
                "model": "m",
                "action": "a",
                "estimand": "S_99",
                "evaluation": {"K": 4, "n_docs": 48, "half_width": 0.01},
            },
        ],
    }
    table = pl.DataFrame(
        {
            "model": ["m"] * 3,
            "action": ["a"] * 3,
            "contrast": [""] * 3,
            "stratum": ["pooled", "pooled", "2k"],
            "estimand": ["R_smc", "S_99", "R_smc"],
            "ci_low": [0.10, 0.20, 0.0],
            "ci_high": [0.16, 0.30, 1.0],
            "ci_level": [0.95, 0.99375, 0.95],
        }
    )
    check = predicted_vs_achieved(plan, table)
    r_smc, s_99 = check.row(0, named=True), check.row(1, named=True)
    assert r_smc["achieved"] == pytest.approx(0.03) and r_smc["ratio"] == pytest.approx(1.5)
    assert r_smc["within"] and r_smc["predicted_low"] == 0.01
    # S_99's row is at the family level: the prediction rescaled by z(.99375)/z(.95)
    scale = norm.ppf(0.5 + 0.99375 / 2) / norm.ppf(0.975)
    assert s_99["predicted"] == pytest.approx(0.01 * scale)
    assert s_99["achieved"] == pytest.approx(0.05) and not s_99["within"]
    text = render_plan_check(check)
    assert (
        "| m | a | R_smc | 0.95 | 4 | 48 | 0.0200 | [0.0100, 0.0300] | 0.0300 | 1.50x | yes |"
        in (text)
    )
