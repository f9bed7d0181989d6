"""SWRB's survival weights (``docs/method.md``, "Survival-weighted residual branching"): the law
of the branch point along a scan.

Numpy only, shared by the finite-state SWRB estimator, the language-model SWRB rollouts and
their analysis.
"""

from __future__ import annotations

import numpy as np

__all__ = ["survival_weights"]


def survival_weights(e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w_s = e_s Π_{r<s}(1 − e_r) along the last axis, and M = Σ_s w_s (clipped to [0, 1])."""
    e = np.asarray(e, dtype=np.float64)
    ones = np.ones(e.shape[:-1] + (1,))
    survival = np.cumprod(np.concatenate([ones, 1.0 - e[..., :-1]], axis=-1), axis=-1)
    w = e * survival
    return w, np.clip(w.sum(-1), 0.0, 1.0)
