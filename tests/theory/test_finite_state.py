"""kvdiverge.theory.finite_state: kernel pairs, exact DP, naive and SWRB."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
from exact_small import exact_summary, exact_window

from kvdiverge.config import ConfigError, validate_config
from kvdiverge.theory import identification as ident
from kvdiverge.theory.coupling import tv
from kvdiverge.theory.finite_state import (
    FiniteStateKernelPair,
    coupled_rollouts,
    exact_risk,
    hoeffding_halfwidth,
    identified_interval_estimate,
    naive_replicates,
    random_machine,
    swrb_replicates,
    swrb_weight_bound,
)
from kvdiverge.theory.finite_state_study import (
    family,
    family_parameters,
    study_summary,
    study_tables,
)

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
SYSTEMS_COLUMNS = [
    "system",
    "lambda_scale",
    "H",
    "n_states",
    "n_reps",
    "exact_R",
    "exact_O",
    "exact_Pi",
    "naive_mean",
    "naive_var",
    "swrb_mean",
    "swrb_var",
    "var_ratio",
    "naive_cost",
    "swrb_cost",
    "advantage",
]


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def random_pair(
    seed: int, n_states: int, n_tokens: int, eos_prob: float, mix: float, sparse: bool = False
) -> FiniteStateKernelPair:
    """A random machine with Q = (1 − mix)P + mix·D (optionally with disjoint-support states)."""
    rng = np.random.default_rng(seed)
    P, trans, eos = random_machine(rng, n_states, n_tokens, eos_prob, 1.0)
    D = rng.dirichlet(np.ones(n_tokens), size=P.shape[0])
    Q = (1 - mix) * P + mix * D
    if sparse:  # state 1: P and Q on disjoint tokens, so e = 1 there
        words = n_tokens - 1 if eos is not None else n_tokens
        P[1] = 0.0
        P[1, 0] = 1.0
        Q[1] = 0.0
        Q[1, 1:words] = 1.0 / (words - 1)
    if eos is not None:
        Q[n_states] = P[n_states]
    return FiniteStateKernelPair(P=P, Q=Q, transition=trans, init_state=0, eos=eos)


def as_history_kernels(pair: FiniteStateKernelPair):
    """The pair as history → distribution callables, for the brute-force enumerator."""

    def state(history: tuple[int, ...]) -> int:
        s = pair.init_state
        for token in history:
            s = int(pair.transition[s, token])
        return s

    return (lambda h: pair.P[state(h)]), (lambda h: pair.Q[state(h)])


def geometric_pair(e: float) -> FiniteStateKernelPair:
    """History-independent kernel pair (one state) with TV(P, Q) = e."""
    P = np.array([[0.5, 0.5, 0.0]])
    Q = np.array([[0.5 - e / 2, 0.5 - e / 2, e]])
    return FiniteStateKernelPair(P=P, Q=Q, transition=np.zeros((1, 3), dtype=int), init_state=0)


def within_se(samples: np.ndarray, exact: float, k: float = 4.0) -> bool:
    se = samples.std(ddof=1) / np.sqrt(samples.size)
    return abs(samples.mean() - exact) <= k * se + 1e-15


def small_config(**overrides) -> dict:
    section = {
        "n_systems": 5,
        "horizon": 8,
        "n_states": 3,
        "n_tokens": 4,
        "eos_prob": 0.1,
        "dirichlet_alpha": 1.0,
        "alt_strength": 0.4,
        "n_reps": 3000,
        "window_depths": [1, 3, 8],
        "interval_figure_systems": [0, 4],
        "alpha": 0.05,
    }
    section.update(overrides)
    return {"seed": 11, "finite_state": section}


TINY = [
    # (seed, n_states, n_tokens, eos_prob, mix, sparse, H)
    (1, 2, 3, 0.2, 0.5, False, 4),
    (2, 3, 3, 0.0, 0.7, False, 4),
    (3, 3, 4, 0.3, 0.4, True, 3),
    (4, 1, 3, 0.25, 0.6, False, 5),
]


# ----------------------------------------------------------------------------------------------
# FiniteStateKernelPair validation
# ----------------------------------------------------------------------------------------------


def test_pair_is_read_only_copy():
    P = np.array([[0.5, 0.5]])
    pair = FiniteStateKernelPair(P=P, Q=P.copy(), transition=np.zeros((1, 2), int), init_state=0)
    P[0, 0] = 0.9
    assert pair.P[0, 0] == 0.5
    with pytest.raises(ValueError):
        pair.P[0, 0] = 0.1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"P": np.array([[0.5, 0.6]])}, "FiniteStateKernelPair.P: row 0 sums to 1.1"),
        ({"Q": np.array([[0.5, 0.5, 0.0]])}, "FiniteStateKernelPair.Q: expected shape (1, 2)"),
        ({"Q": np.array([[1.5, -0.5]])}, "FiniteStateKernelPair.Q: expected finite non-negative"),
        ({"transition": np.array([[0, 1]])}, "FiniteStateKernelPair.transition: expected states"),
        ({"transition": np.array([[0.0, 0.0]])}, "FiniteStateKernelPair.transition: expected an"),
        ({"init_state": 3}, "FiniteStateKernelPair.init_state: expected a state in [0, 1)"),
        ({"eos": 5}, "FiniteStateKernelPair.eos: expected a token in [0, 2)"),
        ({"eos": 1}, "FiniteStateKernelPair.eos: state 0 reached by EOS must be absorbing"),
    ],
)
def test_pair_validation(kwargs, message):
    base = {
        "P": np.array([[0.5, 0.5]]),
        "Q": np.array([[0.25, 0.75]]),
        "transition": np.zeros((1, 2), dtype=int),
        "init_state": 0,
        "eos": None,
    }
    base.update(kwargs)
    with pytest.raises(ValueError) as err:
        FiniteStateKernelPair(**base)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_absorbing_eos_state_accepted():
    pair = random_pair(0, 3, 4, 0.1, 0.3)
    assert pair.eos == 3
    assert pair.absorbing_states().tolist() == [False, False, False, True]


# ----------------------------------------------------------------------------------------------
# Exact DP against brute-force enumeration and closed forms
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("seed", "S", "V", "eos", "mix", "sparse", "H"), TINY)
def test_dp_matches_brute_force(seed, S, V, eos, mix, sparse, H):
    pair = random_pair(seed, S, V, eos, mix, sparse)
    ex = exact_risk(pair, H)
    brute = exact_summary(*as_history_kernels(pair), H)
    np.testing.assert_allclose(ex.p, brute["p"], atol=1e-13)
    defined = ~np.isnan(brute["rho"])
    np.testing.assert_allclose(ex.rho[defined], brute["rho"][defined], atol=1e-12)
    assert np.all(ex.rho[~defined] == 0)
    for mine, theirs in (("R_smc", "R_SMC"), ("O_H", "O_H"), ("Pi_H", "Pi_H"), ("E_H", "E_H")):
        assert getattr(ex, mine) == pytest.approx(brute[theirs], abs=1e-13)
    assert ex.C_H == pytest.approx(brute["C_H"], abs=1e-12)
    assert ex.R_smc == pytest.approx(ex.O_H + ex.Pi_H, abs=1e-15)
    assert ex.mismatch.sum() / H == pytest.approx(brute["R_SMC"], abs=1e-13)
    # R = R_SMC (E[I_t | past] = δ_t)
    assert brute["R"] == pytest.approx(ex.R_smc, abs=1e-13)
    for L in (1, 2, H, H + 3):
        window = exact_window(brute["paths"], H, L)
        assert ex.R_L(L) == pytest.approx(window["R_L"], abs=1e-13)
        assert ex.B_L(L) == pytest.approx(window["B_L"], abs=1e-13)
        low, high = ident.identified_interval(ex.p, ex.rho, H, L)
        assert (low, high) == pytest.approx((ex.R_L(L), ex.R_L(L) + ex.B_L(L)), abs=1e-15)
        tail = ident.realized_tail(ex.p, ex.rho, H, L)
        assert tail == pytest.approx(window["tail"], abs=1e-13)
        assert tail == pytest.approx(ex.R_smc - ex.R_L(L), abs=1e-13)
        assert -1e-15 <= tail <= ex.B_L(L) + 1e-15


@pytest.mark.parametrize("e", [0.0, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("H", [1, 7])
def test_dp_geometric_closed_forms(e, H):
    ex = exact_risk(geometric_pair(e), H)
    s = np.arange(1, H + 1)
    np.testing.assert_allclose(ex.p, (1 - e) ** (s - 1) * e, atol=1e-15)
    assert ex.O_H == pytest.approx((1 - (1 - e) ** H) / H, abs=1e-15)
    assert ex.R_smc == pytest.approx(e, abs=1e-14)
    assert ex.Pi_H == pytest.approx(e - (1 - (1 - e) ** H) / H, abs=1e-14)
    for entry in s[ex.p > 0]:
        np.testing.assert_allclose(ex.rho[entry - 1, 1 : H - entry + 1], e, atol=1e-14)


# ----------------------------------------------------------------------------------------------
# Coupled rollouts
# ----------------------------------------------------------------------------------------------


def test_coupled_rollouts_reproducible_and_consistent():
    pair = random_pair(5, 3, 4, 0.15, 0.5)
    H, n = 6, 4000
    a = coupled_rollouts(pair, H, n, seed=3, document=2)
    b = coupled_rollouts(pair, H, n, seed=3, document=2)
    c = coupled_rollouts(pair, H, n, seed=4, document=2)
    for key in a:
        assert a[key].shape == (n, H)
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(a["x"], c["x"])
    # a subset of paths replays exactly (counter-based CRN)
    head = coupled_rollouts(pair, H, 10, seed=3, document=2)
    np.testing.assert_array_equal(head["y"], a["y"][:10])
    np.testing.assert_array_equal(a["mismatch"], a["x"] != a["y"])
    # EOS flags: absorbing and monotone
    assert np.all(np.diff(a["x_eos"].astype(int), axis=1) >= 0)
    after_eos = a["x_eos"][:, :-1]
    assert np.all(a["x"][:, 1:][after_eos] == pair.eos)
    # mismatch rate and E[δ_t] match the DP per step
    ex = exact_risk(pair, H)
    brute = exact_summary(*as_history_kernels(pair), H)
    for t in range(H):
        assert within_se(a["mismatch"][:, t].astype(float), ex.mismatch[t])
        assert within_se(a["tv_rollout"][:, t], ex.mismatch[t])
    assert within_se(a["mismatch"].mean(1), ex.R_smc)
    assert within_se(a["tv_fixed"].mean(1), brute["F"])


def test_coupled_rollouts_marginal_of_reference():
    pair = random_pair(8, 2, 3, 0.0, 0.6)
    a = coupled_rollouts(pair, 1, 20000, seed=9)
    for v in range(3):
        assert within_se((a["x"][:, 0] == v).astype(float), pair.P[0, v])
        assert within_se((a["y"][:, 0] == v).astype(float), pair.Q[0, v])


# ----------------------------------------------------------------------------------------------
# Estimators
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_family():
    cfg = small_config()
    H = cfg["finite_state"]["horizon"]
    out = []
    for system, pair in enumerate(family(cfg)):
        out.append(
            (
                pair,
                exact_risk(pair, H),
                naive_replicates(pair, H, 10000, seed=1, document=system),
                swrb_replicates(pair, H, 10000, seed=1, document=system),
            )
        )
    return out


def test_estimators_unbiased_in_every_system(small_family):
    for _pair, ex, naive, swrb in small_family:
        for reps in (naive, swrb):
            assert within_se(reps.Z_R(), ex.R_smc)
            assert within_se(reps.Z_O(), ex.O_H)
            assert within_se(reps.Z_Pi(), ex.Pi_H)
            for L in (1, 3, 8):
                assert within_se(reps.Z_L(L), ex.R_L(L))
                assert within_se(reps.W_L(L), ex.B_L(L))
                assert within_se(reps.Z_R() - reps.Z_L(L), ex.R_smc - ex.R_L(L))
                assert -1e-15 <= ex.R_smc - ex.R_L(L) <= ex.B_L(L) + 1e-15


@pytest.mark.parametrize(("seed", "S", "V", "eos", "mix", "sparse", "H"), TINY)
def test_estimators_unbiased_when_divergence_is_common(seed, S, V, eos, mix, sparse, H):
    pair = random_pair(seed, S, V, eos, mix, sparse)
    ex = exact_risk(pair, H)
    for reps in (
        naive_replicates(pair, H, 20000, seed=seed),
        swrb_replicates(pair, H, 20000, seed=seed),
    ):
        assert within_se(reps.Z_R(), ex.R_smc)
        assert within_se(reps.Z_O(), ex.O_H)
        assert within_se(reps.Z_Pi(), ex.Pi_H)
        for L in (1, 2):
            assert within_se(reps.Z_L(L), ex.R_L(L))
            assert within_se(reps.W_L(L), ex.B_L(L))


def _variance_se(x: np.ndarray) -> float:
    """Asymptotic standard error of the sample variance: sqrt((μ4 − σ⁴)/n)."""
    centred = x - x.mean()
    return float(np.sqrt(max((centred**4).mean() - centred.var() ** 2, 0.0) / x.size))


def test_swrb_variance_below_naive_in_every_system(small_family):
    for _pair, _ex, naive, swrb in small_family:
        zn, zs = naive.Z_R(), swrb.Z_R()
        gap = zn.var(ddof=1) - zs.var(ddof=1)
        assert gap > 4 * np.hypot(_variance_se(zn), _variance_se(zs))


def test_swrb_bounds_hold_per_replicate(small_family):
    for pair, ex, _naive, swrb in small_family:
        H = ex.H
        M = swrb.weight
        assert np.all((M >= 0) & (M <= swrb_weight_bound(pair, H) + 1e-12))
        assert within_se(M, ex.divergence_probability)
        for L in (1, 3, 8):
            z, w = swrb.Z_L(L), swrb.W_L(L)
            assert np.all((z >= 0) & (z <= M * L / H + 1e-15))
            assert np.all((w >= 0) & (w <= M * max(H - L, 0) / H + 1e-15))
            assert np.all(z + w <= 1 + 1e-15)
            est = identified_interval_estimate(swrb, L, 0.05, swrb_weight_bound(pair, H))
            assert est["R_L_lo"] <= ex.R_L(L) <= est["R_L_hi"]
            assert est["upper_lo"] <= ex.R_L(L) + ex.B_L(L) <= est["upper_hi"]


def test_hoeffding_halfwidth():
    assert hoeffding_halfwidth(200, 2.0, 0.1) == pytest.approx(2.0 * np.sqrt(np.log(20) / 400))
    with pytest.raises(ValueError, match="alpha"):
        hoeffding_halfwidth(10, 1.0, 1.5)


def test_costs_without_eos_are_exact():
    pair = random_pair(2, 3, 3, 0.0, 0.7)
    H, n = 6, 500
    naive = naive_replicates(pair, H, n, seed=2)
    swrb = swrb_replicates(pair, H, n, seed=2)
    assert np.all(naive.cost == H)
    # scan over all H steps, residual at J reuses the scan, continuation J+1..H
    assert np.all(swrb.cost == H + (H - swrb.entry))
    assert np.all(swrb.entry <= H) and np.all(swrb.weight > 0)


def test_scan_stops_where_supports_are_disjoint():
    P = np.array([[1.0, 0.0], [0.5, 0.5]])
    Q = np.array([[0.0, 1.0], [0.5, 0.5]])
    trans = np.array([[1, 1], [1, 1]])
    pair = FiniteStateKernelPair(P=P, Q=Q, transition=trans, init_state=0)
    swrb = swrb_replicates(pair, 5, 50, seed=0)
    assert np.all(swrb.weight == 1.0) and np.all(swrb.entry == 1)
    assert np.all(swrb.cost == 1 + 4)  # one scan step (e = 1), four continuation steps
    assert np.all(swrb.Z_R() == 1 / 5)  # after the first step both chains share state 1


def test_scan_stops_at_eos_absorption():
    pair = geometric_pair(0.0)  # never diverges: M = 0, no continuation
    swrb = swrb_replicates(pair, 4, 10, seed=0)
    assert np.all(swrb.weight == 0) and np.all(swrb.Z_R() == 0) and np.all(swrb.cost == 4)
    eos_pair = random_pair(1, 2, 3, 0.999999, 0.0)  # EOS at once; Q = P, never diverges
    swrb = swrb_replicates(eos_pair, 6, 200, seed=0)
    naive = naive_replicates(eos_pair, 6, 200, seed=0)
    assert np.all(swrb.Z_R() == 0) and np.all(naive.Z_R() == 0)
    assert swrb.cost.mean() < 1.01 and naive.cost.mean() < 1.01  # both stop once absorbed


# ----------------------------------------------------------------------------------------------
# The family, the study tables and the configuration
# ----------------------------------------------------------------------------------------------


def test_family_mixing_weights():
    cfg = small_config(n_systems=25)
    params = family_parameters(cfg)
    assert [p["c"] for p in params] == list(range(25))
    for p in params:
        assert 0.5 <= p["U"] <= 1 and 0 <= p["V"] <= 1
        assert p["lambda"] == pytest.approx((0.05 + 0.45 * p["c"] / 24) * p["U"] * p["V"])
    assert family_parameters(cfg) == params
    pairs = family(cfg)
    assert len(pairs) == 25
    live = ~pairs[0].absorbing_states()
    # Q = (1 − λ)P + λA with A = (1 − κ)P + κD: TV(P, Q) ≤ λκ on live states
    for p, pair, again in zip(params, pairs, family(cfg), strict=True):
        assert np.all(tv(pair.P, pair.Q)[live] <= p["lambda"] * 0.4 + 1e-15)
        np.testing.assert_array_equal(again.Q, pair.Q)
        np.testing.assert_array_equal(again.transition, pair.transition)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_tokens": 2}, "config.finite_state.n_tokens: expected at least 3"),
        ({"interval_figure_systems": [9]}, "config.finite_state.interval_figure_systems"),
    ],
)
def test_family_consistency_errors(overrides, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        family(small_config(**overrides))


def test_family_requires_validated_config():
    cfg = small_config()
    del cfg["finite_state"]["alt_strength"]
    with pytest.raises(ValueError, match=r"config\.finite_state\.alt_strength: missing"):
        family(cfg)


def test_study_tables_and_summary():
    cfg = small_config(n_systems=3, n_reps=500, interval_figure_systems=[0, 2])
    systems, windows = study_tables(cfg)
    assert systems.columns == SYSTEMS_COLUMNS
    assert systems.height == 3 and windows.height == 3 * 3
    row = systems.row(0, named=True)
    assert row["var_ratio"] == pytest.approx(row["naive_var"] / row["swrb_var"])
    assert row["advantage"] == pytest.approx(
        row["var_ratio"] * row["naive_cost"] / row["swrb_cost"]
    )
    pair = family(cfg)[0]
    ex = exact_risk(pair, 8)
    assert row["exact_R"] == ex.R_smc and row["n_states"] == pair.n_states == 4
    summary = study_summary(systems)
    assert summary["var_ratio_median"] == pytest.approx(float(np.median(systems["var_ratio"])))
    assert summary["cost_factor"] == pytest.approx(
        systems["swrb_cost"].mean() / systems["naive_cost"].mean()
    )
    assert windows.filter(windows["L"] == 8)["exact_B_L"].to_list() == [0.0, 0.0, 0.0]


def _validated(section: dict) -> dict:
    cfg = {"finite_state": section}
    validate_config(cfg, SCHEMA)
    return cfg


def test_schema_fills_defaults_matching_config_yaml():
    import yaml

    cfg = _validated({})
    embedded = yaml.safe_load((ROOT / "config.yaml").read_text())["finite_state"]
    assert cfg["finite_state"] == embedded
    assert len(family({"seed": 0, **cfg})) == embedded["n_systems"]


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"horizon": 0}, "config.finite_state.horizon: expected a value >= 1, got 0"),
        ({"horizon": -3}, "config.finite_state.horizon: expected a value >= 1"),
        ({"n_reps": -1}, "config.finite_state.n_reps: expected a value >= 2"),
        ({"n_systems": 0}, "config.finite_state.n_systems: expected a value >= 1"),
        ({"n_states": "six"}, "config.finite_state.n_states: expected integer, got 'six'"),
        ({"eos_prob": 1.0}, "config.finite_state.eos_prob: expected a value < 1"),
        ({"alt_strength": "x"}, "config.finite_state.alt_strength: expected number"),
        ({"window_depths": [0]}, "config.finite_state.window_depths[0]: expected a value >= 1"),
        ({"horizonn": 3}, "config.finite_state: unknown key(s) 'horizonn'"),
    ],
)
def test_schema_rejects_bad_config(section, message):
    with pytest.raises(ConfigError) as err:
        _validated(copy.deepcopy(section))
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)
