"""What a finite window after divergence identifies (`docs/method.md`, "What a window identifies").

Conventions (public; other modules rely on them):

* ``window_lengths(H, L)[s-1] = ℓ_s = min(L, H − s + 1)``, s = 1..H.
* ``p`` is an array ``(..., H)`` with ``p[..., s-1] = p_s = P(τ = s)``.
* ``rho`` is an array ``(..., H, H)`` with ``rho[..., s-1, j] = ρ_{s,j} = P(I_{s+j} = 1 | τ = s)``
  for 0 ≤ j ≤ H − s. Entries beyond j = H − s are ignored, and so are the rows of entry times
  with p_s = 0 (ρ is a conditional law given a null event there; NaN is fine). Functions that
  only read the window ignore entries with j ≥ ℓ_s as well.
* Leading batch dimensions (e.g. bootstrap draws) broadcast; an interval is a pair
  ``(low, high)`` of floats or arrays.

Validation raises ``ValueError`` with one line naming the field and what was expected.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from kvdiverge.theory.risk import KernelPair

__all__ = [
    "attaining_kernel_pair",
    "contrast_interval",
    "identified_interval",
    "intersect_intervals",
    "minimax_errors",
    "minimax_midpoint",
    "observed_contribution",
    "realized_tail",
    "sign_identified",
    "unobserved_capacity",
    "window_lengths",
    "worst_case_absolute_error",
    "worst_case_squared_error",
]

_TOL = 1e-9


def _check_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return int(value)


def window_lengths(H: int, L: int) -> np.ndarray:
    """Observed window length ℓ_s = min(L, H − s + 1) for s = 1..H; int array (H,).

    L ≥ 1: the divergence step itself (I_τ = 1) is always inside the window.
    """
    H = _check_int(H, "H", 1)
    L = _check_int(L, "L", 1)
    return np.minimum(L, H - np.arange(1, H + 1) + 1)


def _validate_p(p: Any, H: int) -> np.ndarray:
    p = np.asarray(p, dtype=np.float64)
    if p.ndim < 1 or p.shape[-1] != H:
        raise ValueError(f"p: expected an array (..., H) with H = {H}, got shape {p.shape}")
    if not np.isfinite(p).all() or (p < 0).any():
        raise ValueError("p: expected finite first-divergence probabilities p_s >= 0")
    if (p.sum(-1) > 1 + _TOL).any():
        raise ValueError(f"p: expected sum_s p_s <= 1, got {float(p.sum(-1).max())!r}")
    return p


def _validate_rho(rho: Any, p: np.ndarray, H: int, used: np.ndarray, name: str) -> np.ndarray:
    """Check ρ on the ``used`` (H, H) mask for rows with p_s > 0; return ρ with the rest zeroed."""
    rho = np.asarray(rho, dtype=np.float64)
    if rho.ndim < 2 or rho.shape[-2:] != (H, H):
        raise ValueError(
            f"{name}: expected an array (..., H, H) with H = {H}, got shape {rho.shape}"
        )
    relevant = used & (p[..., :, None] > 0)
    values = np.where(relevant, rho, 0.0)
    if not np.isfinite(values).all() or (values < -_TOL).any() or (values > 1 + _TOL).any():
        raise ValueError(f"{name}: expected branch probabilities rho[s-1, j] in [0, 1]")
    if (np.abs(np.where(p > 0, rho[..., :, 0], 1.0) - 1.0) > _TOL).any():
        raise ValueError(f"{name}: expected rho[s-1, 0] = 1 wherever p_s > 0 (I_tau = 1)")
    return np.clip(values, 0.0, 1.0)


def _window_mask(H: int, L: int) -> np.ndarray:
    """(H, H) mask of the observed window: j < ℓ_s in row s − 1."""
    return np.arange(H)[None, :] < window_lengths(H, L)[:, None]


def _horizon_mask(H: int) -> np.ndarray:
    """(H, H) mask of the defined branch profile: j ≤ H − s in row s − 1."""
    return np.arange(H)[None, :] <= (H - np.arange(1, H + 1))[:, None]


def observed_contribution(p: Any, rho: Any, H: int, L: int) -> Any:
    """Observed contribution R_L = (1/H) Σ_s p_s Σ_{j<ℓ_s} ρ_{s,j}."""
    mask = _window_mask(H, L)
    p = _validate_p(p, H)
    rho = _validate_rho(rho, p, H, mask, "rho")
    return (p * rho.sum(-1)).sum(-1) / H


def unobserved_capacity(p: Any, H: int, L: int) -> Any:
    """Unobserved capacity B_L = (1/H) Σ_s p_s (H − s + 1 − ℓ_s)."""
    unobserved = H - np.arange(1, H + 1) + 1 - window_lengths(H, L)
    p = _validate_p(p, H)
    return (p * unobserved).sum(-1) / H


def identified_interval(p: Any, rho: Any, H: int, L: int) -> tuple[Any, Any]:
    """Sharp identified set of R_SMC given the summary S_L = (p, ρ): [R_L, R_L + B_L]."""
    low = observed_contribution(p, rho, H, L)
    return low, low + unobserved_capacity(p, H, L)


def realized_tail(p: Any, rho_full: Any, H: int, L: int) -> Any:
    """Realised tail R_H − R_L = (1/H) Σ_{s: p_s>0} p_s Σ_{j=ℓ_s}^{H−s} ρ_{s,j}.

    ``rho_full`` is the full branch profile (0 ≤ j ≤ H − s); the result lies in [0, B_L].
    """
    mask = _horizon_mask(H) & ~_window_mask(H, L)
    p = _validate_p(p, H)
    rho = _validate_rho(rho_full, p, H, _horizon_mask(H), "rho_full")
    return (p * np.where(mask, rho, 0.0).sum(-1)).sum(-1) / H


def _interval(interval: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        low, high = interval
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a pair (low, high)") from None
    low, high = np.asarray(low, dtype=np.float64), np.asarray(high, dtype=np.float64)
    if (np.isnan(low) | np.isnan(high)).any() or (low > high).any():
        raise ValueError(f"{name}: expected low <= high, got ({low}, {high})")
    return low, high


def _scalar(value: np.ndarray) -> Any:
    return float(value) if np.ndim(value) == 0 else value


def minimax_midpoint(low: Any, high: Any) -> Any:
    """Minimax point estimate of a target known only to lie in [low, high]: the midpoint."""
    low, high = _interval((low, high), "interval")
    return _scalar(0.5 * (low + high))


def worst_case_absolute_error(estimate: Any, low: Any, high: Any) -> Any:
    """sup over u in [low, high] of |T − u| = max(|T − low|, |T − high|)."""
    low, high = _interval((low, high), "interval")
    t = np.asarray(estimate, dtype=np.float64)
    return _scalar(np.maximum(np.abs(t - low), np.abs(t - high)))


def worst_case_squared_error(estimate: Any, low: Any, high: Any) -> Any:
    """sup over u in [low, high] of (T − u)² = max((T − low)², (T − high)²).

    It is at least the average of the two, (T − low − b/2)² + b²/4 with b = high − low, so at
    least b²/4, with equality at the midpoint.
    """
    return _scalar(np.asarray(worst_case_absolute_error(estimate, low, high)) ** 2)


def minimax_errors(low: Any, high: Any) -> dict[str, Any]:
    """Minimax worst-case errors over [r, r + b]: ``absolute`` = b/2, ``squared`` = b²/4.

    Both are attained by the midpoint (``minimax_midpoint``).
    """
    low, high = _interval((low, high), "interval")
    width = high - low
    return {"absolute": _scalar(width / 2), "squared": _scalar(width**2 / 4)}


def contrast_interval(interval_a: Any, interval_b: Any) -> tuple[Any, Any]:
    """Identified set of R(b) − R(a) from the two actions' intervals.

    ``[r_b_low − r_a_high, r_b_high − r_a_low]``: the two summaries constrain the two kernel
    pairs separately, so every point of the product of the intervals is attainable.
    """
    a_low, a_high = _interval(interval_a, "interval_a")
    b_low, b_high = _interval(interval_b, "interval_b")
    return _scalar(b_low - a_high), _scalar(b_high - a_low)


def sign_identified(interval: Any) -> Any:
    """Sign of a contrast identified by its interval: +1 if low > 0, −1 if high < 0,
    0 (not identified) when the closed interval contains 0."""
    low, high = _interval(interval, "interval")
    sign = np.where(low > 0, 1, np.where(high < 0, -1, 0))
    return int(sign) if np.ndim(sign) == 0 else sign


def intersect_intervals(interval: Any, other: Any) -> tuple[Any, Any]:
    """Intersection of two identified sets, e.g. [R_L, R_L + B_L] with a fixed-reference set.

    With a fixed reference P0 the identified set I_L(P0; p, ρ) stays inside
    [R_L, R_L + B_L], so intersecting can only shrink the interval. An empty intersection means
    the two sets are incompatible and raises ValueError.
    """
    low_a, high_a = _interval(interval, "interval")
    low_b, high_b = _interval(other, "other")
    low, high = np.maximum(low_a, low_b), np.minimum(high_a, high_b)
    if (low > high).any():
        raise ValueError("intersect_intervals: the intervals are disjoint (incompatible sets)")
    return _scalar(low), _scalar(high)


def attaining_kernel_pair(
    p: Any, rho: Any, H: int, L: int, end: Literal["low", "high"] = "low"
) -> KernelPair:
    """An explicit kernel pair with summary S_L = (p, ρ) whose R_SMC is an end of the interval.

    Proves sharpness. Vocabulary {0, 1, 2}; 0 is the "agree" token, P marks a disagreement
    with 1 and Q with 2. Each kernel reads only its own history; s denotes the position of the
    first non-zero token in it (the entry time once the histories have split), t = len + 1.

    * No non-zero token yet (histories agree, all 0s): P_t = (1 − h_t, h_t, 0) and
      Q_t = (1 − h_t, 0, h_t) with the hazard h_t = p_t / P(τ ≥ t) (0 where P(τ ≥ t) = 0).
      The maximal coupling splits with probability h_t into X = 1, Y = 2, so P(τ = s) = p_s;
      mass 1 − Σ p_s never diverges.
    * Inside the window, t = s + j with 1 ≤ j < ℓ_s: P_t = (1 − ρ_{s,j}, ρ_{s,j}, 0) and
      Q_t = (1 − ρ_{s,j}, 0, ρ_{s,j}); δ_t = ρ_{s,j} on every branch history, so
      P(I_{s+j} = 1 | τ = s) = ρ_{s,j}.
    * After the window (j ≥ ℓ_s): ``end="low"``: P_t = Q_t = δ_0 (always agree, I = 0), so
      R_SMC = R_L; ``end="high"``: P_t = δ_1, Q_t = δ_2 (always disagree), so R_SMC = R_L + B_L.
    """
    if end not in ("low", "high"):
        raise ValueError(f"end: expected 'low' or 'high', got {end!r}")
    ell = window_lengths(H, L)
    p = _validate_p(p, H)
    if p.ndim != 1:
        raise ValueError(f"p: expected a single summary of shape ({H},), got {p.shape}")
    rho = _validate_rho(rho, p, H, _window_mask(H, L), "rho")
    if rho.ndim != 2:
        raise ValueError(f"rho: expected a single profile of shape ({H}, {H}), got {rho.shape}")
    never = max(0.0, 1.0 - float(p.sum()))
    at_risk = never + np.cumsum(p[::-1])[::-1]  # P(τ ≥ t) as a tail sum (accurate near 0)
    hazard = np.clip(np.divide(p, at_risk, out=np.zeros(H), where=at_risk > 0), 0.0, 1.0)
    after_window = 1 if end == "high" else 0

    def make_kernel(marker: int) -> Any:
        def kernel(history: tuple[int, ...]) -> np.ndarray:
            t = len(history) + 1
            if t > H:
                raise ValueError(f"history: expected length < H = {H}, got {len(history)}")
            nonzero = [i for i, token in enumerate(history) if token != 0]
            out = np.zeros(3)
            if not nonzero:
                split = hazard[t - 1]
            else:
                s = nonzero[0] + 1
                j = t - s
                split = rho[s - 1, j] if j < ell[s - 1] else after_window
            out[0] = 1.0 - split
            out[marker] = split
            return out

        return kernel

    return KernelPair(make_kernel(1), make_kernel(2), vocab_size=3, horizon=H)
