"""kvdiverge.theory.identification: R_L, B_L, intervals, and the sharp constructions."""

from __future__ import annotations

import numpy as np
import pytest
from exact_small import exact_summary, exact_window, random_kernel
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiverge.theory import identification as ident


def random_summary(rng: np.random.Generator, H: int) -> tuple[np.ndarray, np.ndarray]:
    """A random valid (p, ρ): some p_s = 0, Σ p_s ≤ 1 (sometimes = 1), ρ with exact 0s and 1s."""
    p = rng.dirichlet(np.ones(H + 1))
    p = p[:H] if rng.random() < 0.6 else p[:H] / p[:H].sum()
    p[rng.random(H) < 0.25] = 0.0
    rho = rng.random((H, H))
    rho[rng.random((H, H)) < 0.15] = 0.0
    rho[rng.random((H, H)) < 0.15] = 1.0
    rho[:, 0] = 1.0
    rho[p == 0] = np.nan  # rows of null entry times are ignored
    rho[np.arange(H)[None, :] > (H - np.arange(1, H + 1))[:, None]] = np.nan  # beyond H − s
    return p, rho


# ----------------------------------------------------------------------------------------------
# Window lengths, R_L, B_L and the realised tail
# ----------------------------------------------------------------------------------------------


def test_window_lengths():
    np.testing.assert_array_equal(ident.window_lengths(5, 2), [2, 2, 2, 2, 1])
    np.testing.assert_array_equal(ident.window_lengths(5, 9), [5, 4, 3, 2, 1])
    np.testing.assert_array_equal(ident.window_lengths(1, 1), [1])


def test_hand_case():
    H, L = 3, 1
    p = np.array([0.5, 0.25, 0.0])
    rho = np.array([[1.0, 0.5, 0.25], [1.0, 1.0, np.nan], [np.nan, np.nan, np.nan]])
    # R_L = (0.5 + 0.25)/3; B_L = (0.5·2 + 0.25·1)/3; tail = (0.5·0.75 + 0.25·1)/3.
    low, high = ident.identified_interval(p, rho, H, L)
    assert low == pytest.approx(0.25)
    assert high - low == pytest.approx(1.25 / 3)
    assert ident.realized_tail(p, rho, H, L) == pytest.approx(0.625 / 3)
    assert ident.observed_contribution(p, rho, H, 3) == pytest.approx((0.5 * 1.75 + 0.5) / 3)
    assert ident.unobserved_capacity(p, H, 3) == 0.0


@pytest.mark.parametrize(
    ("seed", "vocab", "H", "sparsity"),
    [(0, 2, 6, 0.0), (1, 3, 4, 0.3), (2, 2, 5, 0.5), (3, 3, 3, 0.0), (4, 2, 1, 0.0)],
)
def test_window_quantities_against_brute_force(seed, vocab, H, sparsity):
    exact = exact_summary(random_kernel(seed, vocab), random_kernel(seed + 50, vocab, sparsity), H)
    p, rho = exact["p"], exact["rho"]
    for L in range(1, H + 2):
        brute = exact_window(exact["paths"], H, L)
        low, high = ident.identified_interval(p, rho, H, L)
        assert low == pytest.approx(brute["R_L"], abs=1e-13)
        assert ident.observed_contribution(p, rho, H, L) == low
        assert ident.unobserved_capacity(p, H, L) == pytest.approx(brute["B_L"], abs=1e-13)
        assert high - low == pytest.approx(brute["B_L"], abs=1e-13)
        tail = ident.realized_tail(p, rho, H, L)
        assert tail == pytest.approx(brute["tail"], abs=1e-13)
        assert -1e-13 <= tail <= brute["B_L"] + 1e-13
        assert low + tail == pytest.approx(exact["R_SMC"], abs=1e-13)
        assert low - 1e-13 <= exact["R_SMC"] <= high + 1e-13
    # The full window observes everything.
    assert ident.observed_contribution(p, rho, H, H) == pytest.approx(exact["R_SMC"], abs=1e-13)


def test_batched_summaries_broadcast():
    rng = np.random.default_rng(8)
    H, L = 6, 2
    summaries = [random_summary(rng, H) for _ in range(5)]
    p = np.stack([s[0] for s in summaries])
    rho = np.stack([s[1] for s in summaries])
    low, high = ident.identified_interval(p, rho, H, L)
    tail = ident.realized_tail(p, np.nan_to_num(rho), H, L)
    for i, (pi, rhoi) in enumerate(summaries):
        one_low, one_high = ident.identified_interval(pi, rhoi, H, L)
        assert (low[i], high[i]) == (pytest.approx(one_low), pytest.approx(one_high))
        assert tail[i] == pytest.approx(ident.realized_tail(pi, np.nan_to_num(rhoi), H, L))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 12))
def test_longer_windows_nest_the_intervals(seed, H):
    p, rho = random_summary(np.random.default_rng(seed), H)
    occurrence = p.sum() / H
    reachable = (p * (H - np.arange(H))).sum() / H  # every post-entry step mismatches
    previous = (occurrence, reachable)
    for L in range(1, H + 1):
        low, high = ident.identified_interval(p, rho, H, L)
        assert previous[0] - 1e-12 <= low <= high <= previous[1] + 1e-12
        previous = (low, high)
    assert previous[1] - previous[0] == pytest.approx(0.0, abs=1e-15)  # L = H identifies R_SMC


# ----------------------------------------------------------------------------------------------
# Sharpness: explicit kernel pairs attain both ends
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seed", "H", "L"),
    [
        (0, 1, 1),
        (1, 2, 1),
        (2, 3, 1),
        (3, 4, 2),
        (4, 5, 2),
        (5, 6, 3),
        (6, 7, 2),
        (7, 8, 4),
        (8, 6, 6),
        (9, 5, 1),
        (10, 4, 9),
    ],
)
def test_constructions_attain_both_ends(seed, H, L):
    rng = np.random.default_rng(100 + seed)
    p, rho = random_summary(rng, H)
    low, high = ident.identified_interval(p, rho, H, L)
    assert L >= H or high > low  # a non-trivial interval whenever the window is shorter than H
    ell = ident.window_lengths(H, L)
    for end, after, target in (("low", 0.0, low), ("high", 1.0, high)):
        pair = ident.attaining_kernel_pair(p, rho, H, L, end=end)
        exact = exact_summary(pair.reference, pair.intervention, H)
        np.testing.assert_allclose(exact["p"], p, atol=1e-12)
        for s in np.flatnonzero(p > 0) + 1:
            np.testing.assert_allclose(
                exact["rho"][s - 1, : ell[s - 1]], rho[s - 1, : ell[s - 1]], atol=1e-12
            )
            np.testing.assert_array_equal(exact["rho"][s - 1, ell[s - 1] : H - s + 1], after)
        assert exact["R_SMC"] == pytest.approx(target, abs=1e-12)
        # Its summary reproduces the same interval.
        rebuilt = ident.identified_interval(exact["p"], exact["rho"], H, L)
        assert rebuilt == (pytest.approx(low, abs=1e-12), pytest.approx(high, abs=1e-12))


def test_construction_with_certain_divergence_at_the_end():
    H, L = 4, 2
    p = np.array([0.0, 0.0, 0.0, 1.0])
    rho = np.ones((H, H))
    pair = ident.attaining_kernel_pair(p, rho, H, L, end="high")
    exact = exact_summary(pair.reference, pair.intervention, H)
    assert exact["R_SMC"] == pytest.approx(1 / H)
    assert ident.unobserved_capacity(p, H, L) == 0.0


# ----------------------------------------------------------------------------------------------
# Consequences: minimax, contrasts, signs, fixed reference
# ----------------------------------------------------------------------------------------------


def test_minimax_midpoint_and_errors():
    low, high = 0.1, 0.4
    grid = np.linspace(-0.2, 0.7, 9001)
    worst_abs = ident.worst_case_absolute_error(grid, low, high)
    worst_sq = ident.worst_case_squared_error(grid, low, high)
    mid = ident.minimax_midpoint(low, high)
    errors = ident.minimax_errors(low, high)
    assert mid == pytest.approx(0.25)
    assert grid[np.argmin(worst_abs)] == pytest.approx(mid, abs=1e-12)
    assert worst_abs.min() == pytest.approx(errors["absolute"]) == pytest.approx(0.15)
    assert worst_sq.min() == pytest.approx(errors["squared"]) == pytest.approx(0.15**2)
    # sup (T − u)² ≥ ((T − r)² + (T − r − b)²)/2 = (T − r − b/2)² + b²/4 ≥ b²/4.
    average = ((grid - low) ** 2 + (grid - high) ** 2) / 2
    np.testing.assert_allclose(average, (grid - mid) ** 2 + 0.3**2 / 4, atol=1e-15)
    assert np.all(worst_sq >= average - 1e-15)
    assert ident.worst_case_absolute_error(mid, low, high) == pytest.approx(0.15)


def test_contrast_interval_and_sign():
    a, b = (0.10, 0.20), (0.25, 0.40)
    assert ident.contrast_interval(a, b) == (pytest.approx(0.05), pytest.approx(0.30))
    assert ident.sign_identified(ident.contrast_interval(a, b)) == 1
    assert ident.contrast_interval(b, a) == (pytest.approx(-0.30), pytest.approx(-0.05))
    assert ident.sign_identified(ident.contrast_interval(b, a)) == -1
    overlapping = ident.contrast_interval((0.10, 0.30), (0.25, 0.40))
    assert overlapping == (pytest.approx(-0.05), pytest.approx(0.30))
    assert ident.sign_identified(overlapping) == 0
    assert ident.sign_identified((0.0, 0.2)) == 0  # a closed interval touching 0
    np.testing.assert_array_equal(
        ident.sign_identified((np.array([0.1, -0.3, -0.1]), np.array([0.2, -0.1, 0.1]))),
        [1, -1, 0],
    )


def test_contrast_interval_is_attained_by_constructions():
    rng = np.random.default_rng(21)
    H, L = 4, 2
    (p_a, rho_a), (p_b, rho_b) = random_summary(rng, H), random_summary(rng, H)
    contrast = ident.contrast_interval(
        ident.identified_interval(p_a, rho_a, H, L), ident.identified_interval(p_b, rho_b, H, L)
    )

    def r_smc(p, rho, end):
        pair = ident.attaining_kernel_pair(p, rho, H, L, end=end)
        return exact_summary(pair.reference, pair.intervention, H)["R_SMC"]

    assert r_smc(p_b, rho_b, "low") - r_smc(p_a, rho_a, "high") == pytest.approx(contrast[0])
    assert r_smc(p_b, rho_b, "high") - r_smc(p_a, rho_a, "low") == pytest.approx(contrast[1])


def test_fixed_reference_intersection():
    assert ident.intersect_intervals((0.1, 0.4), (0.2, 0.3)) == (0.2, 0.3)
    assert ident.intersect_intervals((0.1, 0.4), (0.0, 0.3)) == (0.1, 0.3)
    with pytest.raises(ValueError, match="disjoint"):
        ident.intersect_intervals((0.1, 0.2), (0.3, 0.4))


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

H3 = 3
GOOD_P = np.array([0.2, 0.3, 0.1])
GOOD_RHO = np.ones((H3, H3))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: ident.window_lengths(3, 0), "L: expected an integer >= 1"),
        (lambda: ident.window_lengths(0, 2), "H: expected an integer >= 1"),
        (lambda: ident.unobserved_capacity([0.2, -0.1, 0.1], H3, 1), "p: expected finite"),
        (lambda: ident.unobserved_capacity([0.5, 0.4, 0.2], H3, 1), "p: expected sum_s p_s <= 1"),
        (lambda: ident.unobserved_capacity([0.5, 0.4], H3, 1), "p: expected an array"),
        (
            lambda: ident.observed_contribution(GOOD_P, GOOD_RHO * 1.5, H3, 2),
            "rho: expected branch probabilities",
        ),
        (
            lambda: ident.observed_contribution(GOOD_P, np.full((H3, H3), 0.5), H3, 2),
            "rho: expected rho\\[s-1, 0\\] = 1 wherever p_s > 0",
        ),
        (lambda: ident.observed_contribution(GOOD_P, np.ones((2, 2)), H3, 2), "rho: expected"),
        (
            lambda: ident.realized_tail(GOOD_P, np.where(np.eye(H3) > 0, 1.0, np.nan), H3, 1),
            "rho_full: expected branch probabilities",
        ),
        (lambda: ident.attaining_kernel_pair(GOOD_P, GOOD_RHO, H3, 1, end="mid"), "end: expected"),
        (lambda: ident.contrast_interval((0.3, 0.1), (0.0, 0.1)), "interval_a: expected low"),
        (lambda: ident.sign_identified(0.3), "interval: expected a pair"),
    ],
)
def test_validation_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_ignored_entries_may_be_anything():
    # Outside the window (and in rows with p_s = 0) ρ is not read: NaN or out-of-range is fine.
    p = np.array([0.5, 0.0, 0.5])
    rho = np.array([[1.0, 7.0, np.nan], [np.nan, -3.0, 9.0], [1.0, np.nan, np.nan]])
    low, high = ident.identified_interval(p, rho, 3, 1)
    assert low == pytest.approx(1 / 3)
    assert high == pytest.approx((0.5 * 3 + 0.5) / 3)
