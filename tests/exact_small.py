"""Brute-force exact evaluator for tiny history-dependent kernel pairs.

Definitions: `docs/method.md`, "The coupled pair" to "What a window identifies".

Enumerates, depth first, every coupled trajectory pair (x_{1:H}, y_{1:H}) of positive probability
under the stepwise maximal coupling Γ(P, Q) (one-step joint law from
``kvdiverge.theory.coupling.maximal_coupling_joint``) and sums path probability × quantity. It is
deliberately independent of ``kvdiverge.theory.risk`` and ``kvdiverge.theory.identification`` (no
shared code
paths beyond the one-step joint law), so tests can compare the library against it.

A kernel is a callable ``history tuple -> probability vector``; ``reference`` is P_t(·|x_<t),
``intervention`` is Q_t(·|y_<t). Cost grows like (cells of the joint)^H: keep V and H tiny.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvdiverge.theory.coupling import maximal_coupling_joint

Kernel = Callable[[tuple[int, ...]], np.ndarray]


@dataclass(frozen=True)
class CoupledPath:
    """One coupled trajectory pair with its probability and per-step rollout TVs."""

    x: tuple[int, ...]
    y: tuple[int, ...]
    prob: float
    deltas: tuple[float, ...]

    @property
    def mismatches(self) -> tuple[bool, ...]:
        return tuple(a != b for a, b in zip(self.x, self.y, strict=True))

    @property
    def tau(self) -> int | None:
        """1-based first divergence, None for τ = ∞."""
        for t, m in enumerate(self.mismatches, start=1):
            if m:
                return t
        return None


def enumerate_coupled_paths(reference: Kernel, intervention: Kernel, H: int) -> list[CoupledPath]:
    """All coupled pairs of positive probability under the stepwise maximal coupling."""
    paths: list[CoupledPath] = []

    def recurse(x: tuple[int, ...], y: tuple[int, ...], prob: float, deltas: tuple) -> None:
        if len(x) == H:
            paths.append(CoupledPath(x, y, prob, deltas))
            return
        p = np.asarray(reference(x), dtype=np.float64)
        q = np.asarray(intervention(y), dtype=np.float64)
        delta = 0.5 * float(sum(abs(a - b) for a, b in zip(p, q, strict=True)))
        joint = maximal_coupling_joint(p, q)
        for a in range(len(p)):
            for b in range(len(q)):
                if joint[a, b] > 0:
                    recurse(x + (a,), y + (b,), prob * joint[a, b], deltas + (delta,))

    recurse((), (), 1.0, ())
    return paths


def enumerate_reference_paths(reference: Kernel, H: int) -> list[tuple[tuple[int, ...], float]]:
    """All reference sequences x_{1:H} of positive probability under P, with probabilities."""
    out: list[tuple[tuple[int, ...], float]] = []

    def recurse(x: tuple[int, ...], prob: float) -> None:
        if len(x) == H:
            out.append((x, prob))
            return
        p = np.asarray(reference(x), dtype=np.float64)
        for a in range(len(p)):
            if p[a] > 0:
                recurse(x + (a,), prob * p[a])

    recurse((), 1.0)
    return out


def exact_summary(reference: Kernel, intervention: Kernel, H: int) -> dict:
    """Exact risk, timing and window quantities of a tiny kernel pair by enumeration.

    Keys: ``p`` (H,) first-divergence law; ``rho`` (H, H) full branch profile
    rho[s-1, j] = P(I_{s+j} = 1 | τ = s) for j ≤ H − s (NaN beyond, and in rows with p_s = 0);
    ``R_SMC``, ``R`` (from δ), ``F`` (fixed history), ``O_H``, ``E_H``, ``C_H``, ``Pi_H``,
    ``div_cdf`` (H,), ``mean_entry_time``, ``sequence_tv``, ``paths`` (the enumeration), ``H``.
    """
    paths = enumerate_coupled_paths(reference, intervention, H)
    total_prob = math.fsum(c.prob for c in paths)
    assert abs(total_prob - 1.0) < 1e-12, total_prob
    p = np.zeros(H)
    branch = np.zeros((H, H))
    r_smc = r_tv = occ = exp_steps = post = tau_mass = 0.0
    for c in paths:
        ms = c.mismatches
        r_smc += c.prob * sum(ms) / H
        r_tv += c.prob * sum(c.deltas) / H
        tau = c.tau
        if tau is None:
            continue
        p[tau - 1] += c.prob
        occ += c.prob / H
        exp_steps += c.prob * (H - tau)
        post += c.prob * sum(ms[tau:])
        tau_mass += c.prob * tau
        for j in range(H - tau + 1):
            branch[tau - 1, j] += c.prob * ms[tau - 1 + j]
    rho = np.full((H, H), np.nan)
    for s in range(1, H + 1):
        if p[s - 1] > 0:
            rho[s - 1, : H - s + 1] = branch[s - 1, : H - s + 1] / p[s - 1]
    fixed = 0.0
    for x, prob in enumerate_reference_paths(reference, H):
        for t in range(H):
            pt = np.asarray(reference(x[:t]), dtype=np.float64)
            qt = np.asarray(intervention(x[:t]), dtype=np.float64)
            fixed += prob * 0.5 * float(np.abs(pt - qt).sum()) / H
    x_law: dict[tuple[int, ...], float] = {}
    y_law: dict[tuple[int, ...], float] = {}
    for c in paths:
        x_law[c.x] = x_law.get(c.x, 0.0) + c.prob
        y_law[c.y] = y_law.get(c.y, 0.0) + c.prob
    seq_tv = 0.5 * sum(abs(x_law.get(k, 0.0) - y_law.get(k, 0.0)) for k in set(x_law) | set(y_law))
    diverged = p.sum()
    return {
        "H": H,
        "paths": paths,
        "p": p,
        "rho": rho,
        "R_SMC": r_smc,
        "R": r_tv,
        "F": fixed,
        "O_H": occ,
        "E_H": exp_steps / H,
        "C_H": post / exp_steps if exp_steps > 0 else float("nan"),
        "Pi_H": post / H,
        "div_cdf": np.cumsum(p),
        "mean_entry_time": tau_mass / diverged if diverged > 0 else float("nan"),
        "sequence_tv": seq_tv,
    }


def exact_window(paths: list[CoupledPath], H: int, L: int) -> dict[str, float]:
    """Brute-force R_L, B_L and the realised tail for window depth L, path by path.

    R_L sums I_t over the observed window t = τ, …, τ + ℓ_τ − 1 with ℓ_τ = min(L, H − τ + 1);
    B_L counts the unobserved steps after it; the tail sums I_t after the window.
    """
    r_l = b_l = tail = 0.0
    for c in paths:
        tau = c.tau
        if tau is None:
            continue
        ell = min(L, H - tau + 1)
        ms = c.mismatches
        r_l += c.prob * sum(ms[tau - 1 : tau - 1 + ell]) / H
        b_l += c.prob * (H - tau + 1 - ell) / H
        tail += c.prob * sum(ms[tau - 1 + ell :]) / H
    return {"R_L": r_l, "B_L": b_l, "tail": tail}


def random_kernel(seed: int, vocab_size: int, sparsity: float = 0.0) -> Kernel:
    """A history-dependent random kernel: Dirichlet(1) law seeded by (seed, history).

    With ``sparsity`` > 0 some tokens get probability zero (never all of them), so that
    disagreements can be certain on some histories.
    """

    def kernel(history: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng([seed, len(history), *history])
        w = rng.dirichlet(np.ones(vocab_size))
        if sparsity > 0:
            keep = rng.random(vocab_size) >= sparsity
            keep[rng.integers(vocab_size)] = True
            w = np.where(keep, w, 0.0)
            w = w / w.sum()
        return w

    return kernel
