"""kvdiverge.theory.risk: moments against exact enumeration, identities, closed forms."""

from __future__ import annotations

import numpy as np
import pytest
from exact_small import exact_summary, random_kernel
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvdiverge.theory import risk
from kvdiverge.theory.coupling import maximal_coupling_step, tv
from kvdiverge.theory.risk import KernelPair, exact_path_law

# ----------------------------------------------------------------------------------------------
# Strategies
# ----------------------------------------------------------------------------------------------


@st.composite
def mismatch_arrays(draw, horizon=None):
    """(n_paths, H) 0/1 arrays, biased towards late or no divergence so every case appears."""
    H = horizon if horizon is not None else draw(st.integers(1, 12))
    n = draw(st.integers(1, 15))
    density = draw(st.sampled_from([0.0, 0.05, 0.3, 0.7, 1.0]))
    u = draw(arrays(np.float64, (n, H), elements=st.floats(0, 1, exclude_max=True)))
    return (u < density).astype(np.int8)


def loop_statistics(mismatch: np.ndarray) -> dict[str, float]:
    """Plain-loop reference for the timing moments (equal path weights)."""
    n, H = mismatch.shape
    occ = exp_steps = post = total = 0.0
    for row in mismatch.tolist():
        total += sum(row)
        if 1 in row:
            tau = row.index(1) + 1
            occ += 1
            exp_steps += H - tau
            post += sum(row[tau:])
    return {
        "R_SMC": total / (n * H),
        "O_H": occ / (n * H),
        "E_H": exp_steps / (n * H),
        "Pi_H": post / (n * H),
        "C_H": post / exp_steps if exp_steps else float("nan"),
    }


# ----------------------------------------------------------------------------------------------
# Per-path statistics and empirical moments
# ----------------------------------------------------------------------------------------------


def test_first_divergence_hand_case():
    m = np.array([[0, 0, 1, 0, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]])
    np.testing.assert_array_equal(risk.first_divergence(m), [3, 1, 6, 5])
    stats = risk.path_statistics(m)
    np.testing.assert_array_equal(stats["diverged"], [True, True, False, True])
    np.testing.assert_array_equal(stats["post_mismatches"], [1, 0, 0, 0])
    np.testing.assert_array_equal(stats["exposure_steps"], [2, 4, 0, 0])
    np.testing.assert_array_equal(risk.mismatch_fraction(m), [0.4, 0.2, 0.0, 0.2])
    np.testing.assert_allclose(risk.divergence_cdf(m), [0.25, 0.25, 0.5, 0.5, 0.75])
    assert risk.mean_entry_time(m) == pytest.approx((3 + 1 + 5) / 3)


@settings(max_examples=200, deadline=None)
@given(mismatch_arrays())
def test_moments_match_loops_and_occupation_identity(m):
    stats = risk.path_statistics(m)
    # Per path, in integers: Σ_t I_t = 1{τ ≤ H} + Σ_{t>τ} I_t.
    np.testing.assert_array_equal(stats["mismatches"], stats["diverged"] + stats["post_mismatches"])
    expected = loop_statistics(m)
    components = risk.risk_components(m)
    for key in ("R_SMC", "O_H", "E_H", "Pi_H"):
        assert components[key] == pytest.approx(expected[key], abs=1e-14)
    assert components["R_SMC"] == pytest.approx(components["O_H"] + components["Pi_H"], abs=1e-14)
    assert risk.occurrence(m) == components["O_H"]
    assert risk.exposure(m) == components["E_H"]
    assert risk.post_divergence_component(m) == components["Pi_H"]
    assert risk.token_mismatch_risk(m) == pytest.approx(components["R_SMC"], abs=1e-15)
    if np.isnan(expected["C_H"]):
        assert np.isnan(risk.post_divergence_rate(m)) and np.isnan(components["C_H"])
    else:
        assert risk.post_divergence_rate(m) == pytest.approx(expected["C_H"], abs=1e-14)
        assert components["Pi_H"] == pytest.approx(components["E_H"] * components["C_H"], abs=1e-14)


def test_weights_equal_to_replicated_paths():
    rng = np.random.default_rng(3)
    m = (rng.random((7, 9)) < 0.2).astype(int)
    counts = rng.integers(1, 4, size=7)
    replicated = np.repeat(m, counts, axis=0)
    for fn in (
        risk.occurrence,
        risk.exposure,
        risk.post_divergence_component,
        risk.post_divergence_rate,
        risk.token_mismatch_risk,
        risk.mean_entry_time,
    ):
        assert fn(m, weights=counts) == pytest.approx(fn(replicated), abs=1e-14)
    np.testing.assert_allclose(risk.divergence_cdf(m, counts), risk.divergence_cdf(replicated))


# ----------------------------------------------------------------------------------------------
# Gap decomposition
# ----------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12).flatmap(lambda H: st.tuples(mismatch_arrays(H), mismatch_arrays(H))))
def test_gap_decomposition_identity(pair):
    m_a, m_b = pair
    a, b = risk.risk_components(m_a), risk.risk_components(m_b)
    gap = risk.gap_decomposition(a, b)
    delta_r = b["R_SMC"] - a["R_SMC"]
    assert gap["delta_R_SMC"] == pytest.approx(delta_r, abs=1e-14)
    assert gap["sum"] == pytest.approx(delta_r, abs=1e-14)
    assert gap["occurrence"] + gap["exposure"] + gap["rate"] == pytest.approx(delta_r, abs=1e-14)
    assert gap["occurrence"] == pytest.approx(b["O_H"] - a["O_H"], abs=1e-15)
    # Terms as docs/method.md writes them, where both rates are defined.
    if a["E_H"] > 0 and b["E_H"] > 0:
        mean_c = (a["C_H"] + b["C_H"]) / 2
        mean_e = (a["E_H"] + b["E_H"]) / 2
        assert gap["exposure"] == pytest.approx((b["E_H"] - a["E_H"]) * mean_c, abs=1e-14)
        assert gap["rate"] == pytest.approx((b["C_H"] - a["C_H"]) * mean_e, abs=1e-14)
    if gap["delta_R_SMC"] != 0:
        shares = gap["occurrence_share"] + gap["exposure_share"] + gap["rate_share"]
        assert shares == pytest.approx(1.0, abs=1e-13 / abs(gap["delta_R_SMC"]))
    else:
        assert np.isnan(gap["exposure_share"])


def test_gap_decomposition_without_exposure():
    H = 4
    # a: divergence only at the last step (E_H = 0, C_H undefined); b: early, persistent.
    m_a = np.array([[0, 0, 0, 1], [0, 0, 0, 0]])
    m_b = np.array([[1, 1, 0, 1], [0, 0, 0, 0]])
    a, b = risk.risk_components(m_a), risk.risk_components(m_b)
    assert a["E_H"] == 0 and np.isnan(a["C_H"])
    gap = risk.gap_decomposition(a, b)
    assert gap["rate"] == 0.0
    assert gap["exposure"] == pytest.approx(b["Pi_H"])
    assert gap["mean_C_H"] == pytest.approx(b["C_H"]) == pytest.approx(2 / 3)
    assert gap["sum"] == pytest.approx(gap["delta_R_SMC"]) == pytest.approx((3 - 1) / (2 * H))
    # Symmetric roles, and both without exposure.
    reverse = risk.gap_decomposition(b, a)
    assert reverse["rate"] == 0.0 and reverse["exposure"] == pytest.approx(-b["Pi_H"])
    none = risk.gap_decomposition(a, risk.risk_components(np.zeros((3, H))))
    assert none["exposure"] == 0.0 and none["rate"] == 0.0
    assert none["occurrence"] == pytest.approx(-a["O_H"]) == pytest.approx(none["delta_R_SMC"])


def test_gap_decomposition_vectorized_over_draws():
    rng = np.random.default_rng(5)
    draws = 20
    a = {k: rng.random(draws) * 0.2 for k in ("O_H", "E_H")}
    b = {k: rng.random(draws) * 0.2 for k in ("O_H", "E_H")}
    a["Pi_H"], b["Pi_H"] = a["E_H"] * rng.random(draws), b["E_H"] * rng.random(draws)
    a["E_H"][0] = a["Pi_H"][0] = 0.0
    gap = risk.gap_decomposition(a, b)
    for i in range(draws):
        one = risk.gap_decomposition(
            {k: v[i] for k, v in a.items()}, {k: v[i] for k, v in b.items()}
        )
        for key in ("occurrence", "exposure", "rate", "sum", "exposure_share"):
            assert gap[key][i] == pytest.approx(one[key], abs=1e-15)
    np.testing.assert_allclose(gap["sum"], gap["delta_R_SMC"], atol=1e-15)


# ----------------------------------------------------------------------------------------------
# Exact values from small kernel pairs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("seed", "vocab", "H"), [(0, 2, 5), (1, 3, 4), (2, 2, 6), (3, 3, 3)])
def test_exact_moments_against_enumeration(seed, vocab, H):
    pair = KernelPair(random_kernel(seed, vocab), random_kernel(seed + 100, vocab, 0.3), vocab, H)
    law = exact_path_law(pair)
    exact = exact_summary(pair.reference, pair.intervention, H)
    assert law.prob.sum() == pytest.approx(1.0, abs=1e-13)
    components = risk.risk_components(law.mismatch, law.prob)
    for key in ("R_SMC", "O_H", "E_H", "Pi_H", "C_H"):
        assert components[key] == pytest.approx(exact[key], abs=1e-13)
    assert risk.rollout_tv_risk(law.delta, law.prob) == pytest.approx(exact["R"], abs=1e-13)
    # Same expectation: R = R_SMC.
    assert exact["R"] == pytest.approx(exact["R_SMC"], abs=1e-13)
    fixed = np.array(
        [
            [float(tv(pair.reference(x[:t]), pair.intervention(x[:t]))) for t in range(H)]
            for x in map(tuple, law.x.tolist())
        ]
    )
    assert risk.fixed_history_risk(fixed, law.prob) == pytest.approx(exact["F"], abs=1e-13)
    np.testing.assert_allclose(
        risk.divergence_cdf(law.mismatch, law.prob), exact["div_cdf"], atol=1e-13
    )
    assert risk.mean_entry_time(law.mismatch, law.prob) == pytest.approx(
        exact["mean_entry_time"], abs=1e-12
    )
    assert risk.sequence_tv(law) == pytest.approx(exact["sequence_tv"], abs=1e-13)


def constant_pair(e: float, H: int) -> tuple[np.ndarray, np.ndarray]:
    """History-independent laws on 3 tokens with TV(p, q) = e (overlap on two tokens)."""
    p = np.array([0.5 * (1 - e) + e, 0.5 * (1 - e), 0.0])
    q = np.array([0.5 * (1 - e), 0.5 * (1 - e), e])
    assert float(tv(p, q)) == pytest.approx(e)
    return p, q


@pytest.mark.parametrize(("e", "H"), [(0.1, 6), (0.35, 5), (0.8, 4), (1.0, 3), (0.0, 4), (0.5, 1)])
def test_geometric_closed_forms_against_enumeration(e, H):
    p, q = constant_pair(e, H)
    exact = exact_summary(lambda x: p, lambda y: q, H)
    closed = risk.geometric_risks(e, H)
    np.testing.assert_allclose(closed["p_s"], exact["p"], atol=1e-14)
    np.testing.assert_allclose(risk.geometric_first_divergence_law(e, H), exact["p"], atol=1e-14)
    for key in ("O_H", "R_SMC", "Pi_H", "E_H"):
        assert closed[key] == pytest.approx(exact[key], abs=1e-13)
    if exact["E_H"] > 0:
        assert closed["C_H"] == pytest.approx(exact["C_H"], abs=1e-13)
    else:
        assert np.isnan(closed["C_H"])


@pytest.mark.parametrize(("e", "sampler"), [(0.05, "accept"), (0.3, "overlap"), (0.3, "accept")])
def test_geometric_closed_forms_against_simulation(e, sampler):
    H, n = 10, 20_000
    p, q = constant_pair(e, H)
    rng = np.random.default_rng(11)
    mismatch = np.empty((n, H), dtype=bool)
    for t in range(H):
        x, y = maximal_coupling_step(
            np.broadcast_to(p, (n, 3)), np.broadcast_to(q, (n, 3)), rng.random((n, 3)), sampler
        )
        mismatch[:, t] = x != y
    closed = risk.geometric_risks(e, H)
    stats = risk.path_statistics(mismatch)
    per_path = {
        "O_H": stats["diverged"] / H,
        "R_SMC": stats["mismatches"] / H,
        "Pi_H": stats["post_mismatches"] / H,
    }
    components = risk.risk_components(mismatch)
    for key, values in per_path.items():
        se = values.std(ddof=1) / np.sqrt(n)
        assert abs(components[key] - closed[key]) < 4 * se, key
    cdf = risk.divergence_cdf(mismatch)
    exact_cdf = np.cumsum(closed["p_s"])
    assert np.all(np.abs(cdf - exact_cdf) < 4 * np.sqrt(exact_cdf * (1 - exact_cdf) / n) + 1e-12)


@pytest.mark.parametrize(("eps", "H"), [(0.3, 5), (0.01, 8), (1.0, 3), (0.5, 1)])
def test_introductory_example(eps, H):
    example = risk.introductory_example(eps, H)
    law = np.zeros(H)
    law[0] = eps
    for name in ("revert", "persist"):
        np.testing.assert_allclose(example[name]["p_s"], law, atol=1e-15)
        assert example[name]["sequence_tv"] == pytest.approx(eps, abs=1e-15)
        assert example[name]["O_H"] == pytest.approx(eps / H, abs=1e-15)
    assert example["revert"]["R_SMC"] == pytest.approx(eps / H, abs=1e-15)
    assert example["persist"]["R_SMC"] == pytest.approx(eps, abs=1e-15)
    pair = example["persist"]["pair"]
    exact = exact_summary(pair.reference, pair.intervention, H)
    assert exact["R_SMC"] == pytest.approx(eps, abs=1e-15)
    assert exact["sequence_tv"] == pytest.approx(eps, abs=1e-15)


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: risk.first_divergence(np.array([0, 1, 0])),
            "mismatch: expected an \\(n_paths, H\\)",
        ),
        (lambda: risk.occurrence(np.array([[0, 2]])), "mismatch: expected entries"),
        (lambda: risk.occurrence(np.zeros((0, 3))), "mismatch: expected an"),
        (lambda: risk.exposure(np.zeros((2, 3)), weights=[1, -1]), "weights: expected finite"),
        (lambda: risk.exposure(np.zeros((2, 3)), weights=[1, 1, 1]), "weights: expected shape"),
        (lambda: risk.rollout_tv_risk(np.full((2, 3), 1.5)), "delta: expected total variations"),
        (lambda: risk.fixed_history_risk(np.full((2, 3), np.nan)), "f: expected total variations"),
        (lambda: risk.geometric_risks(1.2, 4), "e: expected a probability"),
        (lambda: risk.geometric_risks(0.2, 0), "H: expected an integer horizon"),
        (lambda: risk.introductory_example(-0.1, 3), "eps: expected a probability"),
        (lambda: risk.gap_decomposition({"O_H": 0.1}, {}), "a_stats: missing E_H, Pi_H"),
    ],
)
def test_validation_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
