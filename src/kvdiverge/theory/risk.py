"""Divergence timing, exposure and occupation: τ, O_H, E_H, C_H, Π_H and the gap decomposition.

Implements `docs/method.md`, "Divergence timing and occupation" (and the risks R_SMC, R, F of
"The coupled pair"), as empirical moments over coupled paths.

Conventions
-----------
* Inputs are arrays shaped ``(n_paths, H)``: ``mismatch[i, t-1] = I_t`` of path ``i`` (0/1 or
  bool), ``delta`` the rollout TV δ_t, ``f`` the fixed-history TV f_t.
* First divergence is 1-based: ``tau = s`` means ``I_s = 1`` is the first mismatch; the value
  ``H + 1`` encodes τ = ∞ (no mismatch within the horizon). With that encoding the
  post-divergence exposure ``(H − τ)+`` needs no special case.
* Every moment is a (weighted) average over paths. ``weights=None`` averages the paths equally
  (the empirical moment); otherwise ``weights`` is an ``(n_paths,)`` array of non-negative
  weights, normalized internally. Exact values follow from the exact path law of a small kernel
  pair (``exact_path_law``) by passing its path probabilities as weights; document-level
  averaging (documents weigh equally) by weighting each path 1 / (its document's path count).
* Ratio estimands (C_H, E[τ | τ ≤ H]) are ratios of averages, never averages of ratios.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvdiverge.theory.coupling import maximal_coupling_joint, tv

__all__ = [
    "Kernel",
    "KernelPair",
    "PathLaw",
    "divergence_cdf",
    "exact_path_law",
    "exposure",
    "first_divergence",
    "fixed_history_risk",
    "gap_decomposition",
    "geometric_first_divergence_law",
    "geometric_risks",
    "introductory_example",
    "mean_entry_time",
    "mismatch_fraction",
    "occurrence",
    "path_statistics",
    "post_divergence_component",
    "post_divergence_rate",
    "risk_components",
    "rollout_tv_risk",
    "sequence_tv",
    "token_mismatch_risk",
]

Kernel = Callable[[tuple[int, ...]], np.ndarray]
"""An autoregressive kernel: own history (tuple of token ids, length t − 1) -> next-token law."""


# ----------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------


def _as_mismatch(mismatch: Any, name: str = "mismatch") -> np.ndarray:
    """Validate an (n_paths, H) array of I_t in {0, 1}; return it as bool."""
    a = np.asarray(mismatch)
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(
            f"{name}: expected an (n_paths, H) array with n_paths, H >= 1, got {a.shape}"
        )
    if a.dtype == bool:
        return a
    if not np.issubdtype(a.dtype, np.number) or not np.isin(a, (0, 1)).all():
        raise ValueError(f"{name}: expected entries I_t in {{0, 1}}")
    return a.astype(bool)


def _as_tv(values: Any, name: str) -> np.ndarray:
    """Validate an (n_paths, H) array of total variations in [0, 1]."""
    a = np.asarray(values, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(
            f"{name}: expected an (n_paths, H) array with n_paths, H >= 1, got {a.shape}"
        )
    if not np.isfinite(a).all() or (a < 0).any() or (a > 1 + 1e-6).any():
        raise ValueError(f"{name}: expected total variations in [0, 1]")
    return a


def _normalized_weights(weights: Any, n_paths: int) -> np.ndarray:
    """Path weights summing to one; ``None`` gives equal weights."""
    if weights is None:
        return np.full(n_paths, 1.0 / n_paths)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n_paths,):
        raise ValueError(f"weights: expected shape ({n_paths},) (one per path), got {w.shape}")
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError("weights: expected finite non-negative weights with a positive sum")
    return w / w.sum()


def _check_horizon(H: Any) -> int:
    if isinstance(H, bool) or not isinstance(H, int | np.integer) or H < 1:
        raise ValueError(f"H: expected an integer horizon >= 1, got {H!r}")
    return int(H)


def _check_probability(value: Any, name: str) -> float:
    v = float(value)
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{name}: expected a probability in [0, 1], got {value!r}")
    return v


# ----------------------------------------------------------------------------------------------
# Per-path statistics
# ----------------------------------------------------------------------------------------------


def first_divergence(mismatch: Any) -> np.ndarray:
    """First divergence τ = min{t ≤ H : I_t = 1} per path.

    1-based; the value ``H + 1`` encodes τ = ∞.
    Returns an int64 array of shape (n_paths,).
    """
    m = _as_mismatch(mismatch)
    H = m.shape[1]
    return np.where(m.any(axis=1), m.argmax(axis=1) + 1, H + 1).astype(np.int64)


def mismatch_fraction(mismatch: Any) -> np.ndarray:
    """Per-path mismatch fraction D_H = (1/H) Σ_t I_t; shape (n_paths,)."""
    m = _as_mismatch(mismatch)
    return m.sum(axis=1) / m.shape[1]


def path_statistics(mismatch: Any) -> dict[str, np.ndarray]:
    """Per-path sufficient statistics of divergence timing, each of shape (n_paths,).

    * ``tau``: first divergence (1-based, ``H + 1`` for τ = ∞),
    * ``diverged``: 1{τ ≤ H} (bool),
    * ``mismatches``: Σ_t I_t,
    * ``post_mismatches``: Σ_{t>τ} I_t (0 when τ = ∞),
    * ``exposure_steps``: (H − τ)+.

    Identity per path: ``mismatches == diverged + post_mismatches`` (integers).
    """
    m = _as_mismatch(mismatch)
    H = m.shape[1]
    tau = first_divergence(m)
    diverged = tau <= H
    mismatches = m.sum(axis=1).astype(np.int64)
    return {
        "tau": tau,
        "diverged": diverged,
        "mismatches": mismatches,
        "post_mismatches": mismatches - diverged.astype(np.int64),
        "exposure_steps": np.maximum(H - tau, 0).astype(np.int64),
    }


# ----------------------------------------------------------------------------------------------
# Empirical moments
# ----------------------------------------------------------------------------------------------


def occurrence(mismatch: Any, weights: Any = None) -> float:
    """Occurrence (first-mismatch contribution) O_H = P(τ ≤ H) / H, a path average."""
    m = _as_mismatch(mismatch)
    w = _normalized_weights(weights, m.shape[0])
    return float(w @ m.any(axis=1)) / m.shape[1]


def exposure(mismatch: Any, weights: Any = None) -> float:
    """Post-divergence exposure E_H = E[(H − τ)+] / H, averaged over paths."""
    m = _as_mismatch(mismatch)
    w = _normalized_weights(weights, m.shape[0])
    return float(w @ path_statistics(m)["exposure_steps"]) / m.shape[1]


def post_divergence_component(mismatch: Any, weights: Any = None) -> float:
    """Post-divergence component Π_H = E[Σ_{t>τ} I_t] / H, averaged over paths."""
    m = _as_mismatch(mismatch)
    w = _normalized_weights(weights, m.shape[0])
    return float(w @ path_statistics(m)["post_mismatches"]) / m.shape[1]


def post_divergence_rate(mismatch: Any, weights: Any = None) -> float:
    """Post-divergence mismatch rate C_H = E[Σ_{t>τ} I_t] / E[(H − τ)+].

    A ratio of path averages (= Π_H / E_H). Undefined, returned as NaN, when E_H = 0 (no path
    has a post-divergence step).
    """
    m = _as_mismatch(mismatch)
    w = _normalized_weights(weights, m.shape[0])
    stats = path_statistics(m)
    exposure_mean = float(w @ stats["exposure_steps"])
    if exposure_mean == 0:
        return float("nan")
    return float(w @ stats["post_mismatches"]) / exposure_mean


def token_mismatch_risk(mismatch: Any, weights: Any = None) -> float:
    """Token-mismatch risk R_SMC = E[D_H], averaged over paths."""
    m = _as_mismatch(mismatch)
    w = _normalized_weights(weights, m.shape[0])
    return float(w @ mismatch_fraction(m))


def rollout_tv_risk(delta: Any, weights: Any = None) -> float:
    """Rollout-TV risk R = (1/H) Σ_t E_Γ[δ_t], averaged over paths and steps."""
    d = _as_tv(delta, "delta")
    w = _normalized_weights(weights, d.shape[0])
    return float(w @ d.mean(axis=1))


def fixed_history_risk(f: Any, weights: Any = None) -> float:
    """Fixed-history risk F = (1/H) Σ_t E_{X~P}[f_t], averaged over paths and steps."""
    a = _as_tv(f, "f")
    w = _normalized_weights(weights, a.shape[0])
    return float(w @ a.mean(axis=1))


def divergence_cdf(mismatch: Any, weights: Any = None) -> np.ndarray:
    """Divergence CDF P(τ ≤ t) for t = 1..H; shape (H,)."""
    m = _as_mismatch(mismatch)
    w = _normalized_weights(weights, m.shape[0])
    return w @ np.logical_or.accumulate(m, axis=1).astype(np.float64)


def mean_entry_time(mismatch: Any, weights: Any = None) -> float:
    """Conditional mean entry time E[τ | τ ≤ H]; NaN when no path diverges."""
    m = _as_mismatch(mismatch)
    w = _normalized_weights(weights, m.shape[0])
    tau = first_divergence(m)
    diverged = tau <= m.shape[1]
    mass = float(w @ diverged)
    if mass == 0:
        return float("nan")
    return float(w @ np.where(diverged, tau, 0)) / mass


def risk_components(mismatch: Any, weights: Any = None) -> dict[str, float]:
    """All timing moments of one action: ``R_SMC, O_H, E_H, C_H, Pi_H`` (C_H NaN if E_H = 0).

    The result is the input ``gap_decomposition`` expects. R_SMC = O_H + Π_H holds exactly per
    path (in integers), hence for the averages up to float rounding.
    """
    m = _as_mismatch(mismatch)
    w = _normalized_weights(weights, m.shape[0])
    H = m.shape[1]
    stats = path_statistics(m)
    o = float(w @ stats["diverged"]) / H
    e = float(w @ stats["exposure_steps"]) / H
    pi = float(w @ stats["post_mismatches"]) / H
    return {
        "R_SMC": float(w @ stats["mismatches"]) / H,
        "O_H": o,
        "E_H": e,
        "C_H": pi / e if e > 0 else float("nan"),
        "Pi_H": pi,
    }


# ----------------------------------------------------------------------------------------------
# Gap decomposition
# ----------------------------------------------------------------------------------------------


def gap_decomposition(a_stats: Mapping[str, Any], b_stats: Mapping[str, Any]) -> dict[str, Any]:
    """Gap decomposition ΔR_SMC = ΔO_H + ΔE_H·C̄_H + ΔC_H·Ē_H between actions a and b.

    ``a_stats`` and ``b_stats`` hold ``O_H``, ``E_H`` and ``Pi_H`` (e.g. from
    ``risk_components``; values may be arrays, e.g. bootstrap draws, and broadcast). C_H is
    recomputed as Π_H / E_H. Δ = b − a, bar = mean of the two. Because Π_H = E_H·C_H for each
    action, the identity is exact for any moments (empirical or exact).

    E_H = 0 (C_H undefined, and Π_H = 0): the identity holds for any finite stand-in rate, so
    the undefined rate is replaced by the other action's rate. Then the rate term is 0 and the
    whole post-divergence gap ΔΠ_H is attributed to exposure. If both exposures are 0, both
    rates are taken as 0 and both terms are 0.

    Returns ``occurrence``, ``exposure``, ``rate`` (the three terms), ``sum`` (their sum),
    ``delta_R_SMC`` (= ΔO_H + ΔΠ_H, computed directly), ``delta_O_H``, ``delta_E_H``,
    ``delta_C_H``, ``mean_E_H``, ``mean_C_H`` (after substitution) and the shares
    ``occurrence_share``, ``exposure_share``, ``rate_share`` (term / ΔR_SMC; NaN when
    ΔR_SMC = 0). Scalars come back as floats.
    """
    for name, stats in (("a_stats", a_stats), ("b_stats", b_stats)):
        missing = [k for k in ("O_H", "E_H", "Pi_H") if k not in stats]
        if missing:
            raise ValueError(f"{name}: missing {', '.join(missing)} (expected O_H, E_H, Pi_H)")
    o_a, e_a, pi_a = (np.asarray(a_stats[k], dtype=np.float64) for k in ("O_H", "E_H", "Pi_H"))
    o_b, e_b, pi_b = (np.asarray(b_stats[k], dtype=np.float64) for k in ("O_H", "E_H", "Pi_H"))
    with np.errstate(divide="ignore", invalid="ignore"):
        c_a_raw = np.where(e_a > 0, pi_a / np.where(e_a > 0, e_a, 1.0), np.nan)
        c_b_raw = np.where(e_b > 0, pi_b / np.where(e_b > 0, e_b, 1.0), np.nan)
    c_a = np.where(e_a > 0, c_a_raw, np.where(e_b > 0, c_b_raw, 0.0))
    c_b = np.where(e_b > 0, c_b_raw, np.where(e_a > 0, c_a_raw, 0.0))
    delta_o = o_b - o_a
    delta_e = e_b - e_a
    delta_c = c_b - c_a
    mean_e = 0.5 * (e_a + e_b)
    mean_c = 0.5 * (c_a + c_b)
    occurrence_term = delta_o
    exposure_term = delta_e * mean_c
    rate_term = delta_c * mean_e
    total = occurrence_term + exposure_term + rate_term
    delta_r = (o_b + pi_b) - (o_a + pi_a)
    with np.errstate(divide="ignore", invalid="ignore"):
        safe = np.where(delta_r != 0, delta_r, 1.0)
        shares = {
            f"{k}_share": np.where(delta_r != 0, v / safe, np.nan)
            for k, v in (
                ("occurrence", occurrence_term),
                ("exposure", exposure_term),
                ("rate", rate_term),
            )
        }
    out = {
        "occurrence": occurrence_term,
        "exposure": exposure_term,
        "rate": rate_term,
        "sum": total,
        "delta_R_SMC": delta_r,
        "delta_O_H": delta_o,
        "delta_E_H": delta_e,
        "delta_C_H": delta_c,
        "mean_E_H": mean_e,
        "mean_C_H": mean_c,
        **shares,
    }
    return {k: (float(v) if np.ndim(v) == 0 else v) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------
# Closed forms
# ----------------------------------------------------------------------------------------------


def geometric_first_divergence_law(e: float, H: int) -> np.ndarray:
    """First-divergence law p_s = (1 − e)^{s−1} e, s = 1..H, for constant TV e."""
    e = _check_probability(e, "e")
    H = _check_horizon(H)
    return (1.0 - e) ** np.arange(H) * e


def geometric_risks(e: float, H: int) -> dict[str, Any]:
    """Closed forms for history-independent kernels with constant TV e.

    ``O_H = (1 − (1 − e)^H)/H``, ``R_SMC = e``, ``Pi_H = e − O_H``, ``p_s`` the geometric law;
    also ``E_H = Σ_s p_s (H − s)/H`` and ``C_H = e`` (after divergence every step mismatches
    independently with probability e; NaN when E_H = 0).
    """
    p_s = geometric_first_divergence_law(e, H)
    o = (1.0 - (1.0 - e) ** H) / H
    exposure_h = float(p_s @ (H - np.arange(1, H + 1))) / H
    return {
        "O_H": o,
        "R_SMC": float(e),
        "Pi_H": float(e) - o,
        "E_H": exposure_h,
        "C_H": float(e) if exposure_h > 0 else float("nan"),
        "p_s": p_s,
    }


# ----------------------------------------------------------------------------------------------
# Exact path laws of small kernel pairs
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelPair:
    """An explicit autoregressive kernel pair over a small vocabulary.

    ``reference(x_<t)`` is P_t(· | x_<t) and ``intervention(y_<t)`` is Q_t(· | y_<t): each maps
    its own history (a tuple of token ids of length t − 1) to a probability vector of length
    ``vocab_size``. ``horizon`` is the H the pair was built for.
    """

    reference: Kernel
    intervention: Kernel
    vocab_size: int
    horizon: int


class PathLaw(NamedTuple):
    """Exact law of the stepwise maximal coupling over the horizon: one row per coupled path.

    ``x``, ``y``: (n, H) token ids; ``prob``: (n,) path probabilities (summing to 1);
    ``delta``: (n, H) rollout TV δ_t = TV(P_t(·|x_<t), Q_t(·|y_<t)).
    """

    x: np.ndarray
    y: np.ndarray
    prob: np.ndarray
    delta: np.ndarray

    @property
    def mismatch(self) -> np.ndarray:
        """I_t = 1{X_t ≠ Y_t}, shape (n, H)."""
        return self.x != self.y


def exact_path_law(pair: KernelPair, H: int | None = None) -> PathLaw:
    """Exact law of the stepwise maximal coupling Γ(P, Q) of a small kernel pair.

    Expands all coupled pairs (x_≤t, y_≤t) step by step with the maximal-coupling joint law,
    keeping only cells of positive probability. The number of paths grows geometrically in H:
    meant for tiny vocabularies and horizons. Feed ``law.mismatch`` and ``weights=law.prob``
    to the moment functions of this module for exact values.
    """
    H = _check_horizon(pair.horizon if H is None else H)
    states: list[tuple[tuple[int, ...], tuple[int, ...], float, tuple[float, ...]]] = [
        ((), (), 1.0, ())
    ]
    for _ in range(H):
        expanded = []
        for x, y, prob, deltas in states:
            p = np.asarray(pair.reference(x), dtype=np.float64)
            q = np.asarray(pair.intervention(y), dtype=np.float64)
            delta = float(tv(p, q))
            joint = maximal_coupling_joint(p, q)
            for a, b in zip(*np.nonzero(joint > 0), strict=True):
                expanded.append(
                    (x + (int(a),), y + (int(b),), prob * float(joint[a, b]), deltas + (delta,))
                )
        states = expanded
    return PathLaw(
        x=np.array([s[0] for s in states], dtype=np.int64),
        y=np.array([s[1] for s in states], dtype=np.int64),
        prob=np.array([s[2] for s in states]),
        delta=np.array([s[3] for s in states]),
    )


def sequence_tv(law: PathLaw) -> float:
    """TV between the sequence laws of X_{1:H} and Y_{1:H} under an exact path law."""
    masses: dict[tuple[int, ...], float] = {}
    for seq, sign in ((law.x, 1.0), (law.y, -1.0)):
        for row, prob in zip(map(tuple, seq.tolist()), law.prob.tolist(), strict=True):
            masses[row] = masses.get(row, 0.0) + sign * prob
    return 0.5 * sum(abs(v) for v in masses.values())


def introductory_example(eps: float, H: int) -> dict[str, dict[str, Any]]:
    """The introductory example (figure 1), computed from its two explicit kernel pairs.

    Reference: always emits token 0. Both interventions emit 1 at the first position with
    probability ε; then ``"revert"`` continues with 0s and ``"persist"`` repeats its first
    token (1s after a 1). Each entry holds the exact ``p_s`` (first-divergence law, (H,)),
    ``sequence_tv`` (TV of the two sequence laws), ``R_SMC``, ``O_H``, ``E_H``, ``Pi_H`` and the
    ``pair`` itself. Expected: equal p_s and sequence TV ε, but R_SMC = ε/H versus ε.
    """
    eps = _check_probability(eps, "eps")
    H = _check_horizon(H)
    zero = np.array([1.0, 0.0])
    first = np.array([1.0 - eps, eps])

    def reference(history: tuple[int, ...]) -> np.ndarray:
        return zero

    def revert(history: tuple[int, ...]) -> np.ndarray:
        return first if not history else zero

    def persist(history: tuple[int, ...]) -> np.ndarray:
        return first if not history else np.eye(2)[history[0]]

    out = {}
    for name, intervention in (("revert", revert), ("persist", persist)):
        pair = KernelPair(reference, intervention, vocab_size=2, horizon=H)
        law = exact_path_law(pair)
        tau = first_divergence(law.mismatch)
        p_s = np.bincount(tau, weights=law.prob, minlength=H + 2)[1 : H + 1]
        components = risk_components(law.mismatch, law.prob)
        out[name] = {
            "p_s": p_s,
            "sequence_tv": sequence_tv(law),
            "R_SMC": components["R_SMC"],
            "O_H": components["O_H"],
            "E_H": components["E_H"],
            "Pi_H": components["Pi_H"],
            "pair": pair,
        }
    return out
