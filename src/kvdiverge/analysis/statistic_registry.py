"""The document-level statistics, one entry each: the registry that
:func:`kvdiverge.analysis.document_stats.stat_columns` and
:func:`~kvdiverge.analysis.document_stats.path_statistics` read, and the clock their steps follow.

A statistic is a per-path value computed from one path's I_t, δ_t, f_t and EOS flags
(:class:`PathArrays`); a document's value is its mean over the document's replicates. A scalar
statistic has one column; a profile one column per index (``div_cdf@t``, t = 1..H). Every
estimand (:mod:`kvdiverge.analysis.estimand_registry`) is a function of document averages of
these statistics. Adding one is one :class:`Statistic` in :data:`STATISTICS` (or
:func:`register_statistic`) with its function; the table in
:mod:`kvdiverge.analysis.document_stats`'s docstring defines the built-in ones.

This module imports no other analysis module: the sample-size plan reads it too
(:mod:`kvdiverge.analysis.planning`), and its code is part of the plan's rerun fingerprint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from kvdiverge.theory.risk import first_divergence

__all__ = [
    "STATISTICS",
    "AnalysisInputError",
    "Clock",
    "PathArrays",
    "Statistic",
    "horizon_steps",
    "register_statistic",
    "statistic_columns",
]


class AnalysisInputError(ValueError):
    """An analysis input (trajectory file, documents table, statistics table) is unusable."""


@dataclass(frozen=True)
class Clock:
    """Step counts of the estimands for a horizon H (paper values at H = 128).

    ``branch_depth`` d: the fixed branch cohort τ ≤ d with lags j = 1..d (64);
    ``window``: early lags 1..window and late lags d − window + 1..d (16);
    ``blocks``: generation-clock blocks as inclusive (first, last) steps ((1,32),(33,64),(65,128));
    ``prefix``: prediction features use steps 1..prefix (32);
    ``agreement_run``: local-agreement run length (16); ``saturation``: δ threshold (.99).
    """

    H: int
    branch_depth: int
    window: int
    blocks: tuple[tuple[int, int], ...]
    prefix: int
    agreement_run: int
    saturation: float = 0.99

    def __post_init__(self) -> None:
        h = self.H
        if h < 2:
            raise AnalysisInputError(f"clock: H must be at least 2, got {h}")
        if not 1 <= self.branch_depth <= h // 2:
            raise AnalysisInputError(
                f"clock: branch_depth must lie in 1..H/2 = {h // 2} (τ + j ≤ H), "
                f"got {self.branch_depth}"
            )
        if not 1 <= self.window <= self.branch_depth // 2 or self.window < 1:
            raise AnalysisInputError(
                f"clock: window must lie in 1..branch_depth/2 = {self.branch_depth // 2}, "
                f"got {self.window}"
            )
        if not 1 <= self.prefix <= h:
            raise AnalysisInputError(f"clock: prefix must lie in 1..H = {h}, got {self.prefix}")
        if self.agreement_run < 1:
            raise AnalysisInputError("clock: agreement_run must be at least 1")
        edges = [b for blk in self.blocks for b in blk]
        if not self.blocks or any(lo > hi or lo < 1 or hi > h for lo, hi in self.blocks):
            raise AnalysisInputError(f"clock: blocks must be steps within 1..{h}, got {edges}")

    @classmethod
    def for_horizon(
        cls,
        H: int,
        branch_depth: float = 0.5,
        window: float = 0.125,
        block_edges: Sequence[float] = (0.25, 0.5),
        prefix: float = 0.25,
        agreement_run: float = 0.125,
        saturation: float = 0.99,
    ) -> Clock:
        """The clock with every step count a fraction of H (paper values at H = 128).

        Fractions are rounded to the nearest step (at least 1). ``block_edges`` are the last
        steps of every block but the final one, as fractions of H.
        """
        fractions = (branch_depth, window, block_edges, prefix, agreement_run, saturation)
        return cls(**horizon_steps(H, *fractions))


def horizon_steps(
    H: int,
    branch_depth: float = 0.5,
    window: float = 0.125,
    block_edges: Sequence[float] = (0.25, 0.5),
    prefix: float = 0.25,
    agreement_run: float = 0.125,
    saturation: float = 0.99,
) -> dict[str, Any]:
    """The fields of :meth:`Clock.for_horizon`'s clock, unchecked (a short H's clock that
    :class:`Clock` refuses still has step counts)."""

    def steps(f: float) -> int:
        return max(1, int(round(f * H)))

    ends = sorted({steps(f) for f in block_edges if steps(f) < H}) + [H]
    starts = [1] + [e + 1 for e in ends[:-1]]
    return {
        "H": H,
        "branch_depth": steps(branch_depth),
        "window": max(1, int(round(window * H))),
        "blocks": tuple(zip(starts, ends, strict=True)),
        "prefix": steps(prefix),
        "agreement_run": steps(agreement_run),
        "saturation": saturation,
    }


class PathArrays:
    """One batch of paths: I_t (``mismatch``), δ_t (``delta``), f_t (``fixed``) and the EOS
    flags ("has emitted EOS at or before t"), each (n_paths, H), with the :class:`Clock` (or
    an object with its fields, :func:`horizon_steps`).

    The derived quantities are computed once, when a statistic first asks: τ (the first
    divergence, H + 1 when none), e_X / e_Y (first EOS step, H + 1 when never), e = min and
    e' = max of them, the branch cohort τ ≤ d and its lagged δ_{τ+j}."""

    def __init__(
        self,
        mismatch: np.ndarray,
        delta: np.ndarray,
        fixed: np.ndarray,
        x_eos: np.ndarray,
        y_eos: np.ndarray,
        clock: Clock,
    ) -> None:
        self.mismatch = np.asarray(mismatch, dtype=bool)
        self.delta = np.asarray(delta, dtype=np.float64)
        self.fixed = np.asarray(fixed, dtype=np.float64)
        self.x_eos = np.asarray(x_eos, dtype=bool)
        self.y_eos = np.asarray(y_eos, dtype=bool)
        self.clock = clock
        self.H = self.mismatch.shape[1]
        self.steps = np.arange(1, self.H + 1)

    @cached_property
    def tau(self) -> np.ndarray:
        return first_divergence(self.mismatch)

    @cached_property
    def e_x(self) -> np.ndarray:
        return first_divergence(self.x_eos)

    @cached_property
    def e_y(self) -> np.ndarray:
        return first_divergence(self.y_eos)

    @cached_property
    def e_lo(self) -> np.ndarray:
        return np.minimum(self.e_x, self.e_y)

    @cached_property
    def e_hi(self) -> np.ndarray:
        return np.maximum(self.e_x, self.e_y)

    @cached_property
    def after_tau(self) -> np.ndarray:
        return self.steps[None, :] > self.tau[:, None]

    @cached_property
    def cohort(self) -> np.ndarray:
        """1{τ ≤ d}."""
        return self.tau <= self.clock.branch_depth

    @cached_property
    def lag_steps(self) -> np.ndarray:
        """τ + j for j = 1..d, capped at H (paths outside the cohort are masked later)."""
        d = self.clock.branch_depth
        return np.minimum(self.tau[:, None] + np.arange(1, d + 1)[None, :], self.H)

    @cached_property
    def branch_delta(self) -> np.ndarray:
        """1{τ ≤ d} δ_{τ+j}, j = 1..d."""
        lagged = np.take_along_axis(self.delta, self.lag_steps - 1, axis=1)
        return lagged * self.cohort[:, None]

    @cached_property
    def pre_eos(self) -> np.ndarray:
        """1{τ ≤ d, τ + j < e}, j = 1..d."""
        return self.cohort[:, None] & (self.lag_steps < self.e_lo[:, None])

    def segment(self, k: int) -> np.ndarray:
        """EOS segment S_k as a step mask: S0 t < e, S1 t = e, S2 e < t ≤ e', S3 t > e'."""
        t, lo, hi = self.steps[None, :], self.e_lo[:, None], self.e_hi[:, None]
        return (t < lo, t == lo, (t > lo) & (t <= hi), t > hi)[k]

    @cached_property
    def agreement(self) -> tuple[np.ndarray, np.ndarray]:
        """(longest run of agreements, a mismatch after an agreement) in τ < t < e."""
        window = self.after_tau & (self.steps[None, :] < self.e_lo[:, None])
        agree = window & ~self.mismatch
        agreed_so_far = np.cumsum(agree, axis=1)
        reset_at = np.maximum.accumulate(np.where(agree, 0, agreed_so_far), axis=1)
        longest_run = (agreed_so_far - reset_at).max(1)
        reentry = (window & self.mismatch & (agreed_so_far > 0)).any(1)
        return longest_run, reentry


@dataclass(frozen=True)
class Statistic:
    """A document-level statistic: ``column`` (a profile's stem: columns ``column@i``),
    ``definition`` (its per-path value, for the docs), ``compute`` (the per-path values from
    :class:`PathArrays`: (n_paths,) for a scalar, (n_paths, len(index)) for a profile) and, for
    a profile, ``index`` (its indices for a clock)."""

    column: str
    definition: str
    compute: Callable[[PathArrays], np.ndarray]
    index: Callable[[Clock], Sequence[int]] | None = None

    def columns(self, clock: Clock) -> list[str]:
        """The statistic's column names for ``clock``, in order."""
        if self.index is None:
            return [self.column]
        return [f"{self.column}@{i}" for i in self.index(clock)]


def _steps(clock: Clock) -> range:
    return range(1, clock.H + 1)


def _lags(clock: Clock) -> range:
    return range(1, clock.branch_depth + 1)


def _segment(k: int) -> Statistic:
    return Statistic(
        f"rf_seg{k}",
        f"(1/H) Σ_{{t ∈ S{k}}} (δ_t − f_t), EOS segment S{k}",
        lambda p: ((p.delta - p.fixed) * p.segment(k)).sum(1) / p.H,
    )


_BUILTIN = (
    Statistic("mismatch", "D_H = (1/H) Σ_t I_t", lambda p: p.mismatch.sum(1) / p.H),
    Statistic(
        "mismatch_sq",
        "D_H² (within-document variance for sample-size planning)",
        lambda p: (p.mismatch.sum(1) / p.H) ** 2,
    ),
    Statistic("diverged", "1{τ ≤ H}", lambda p: (p.tau <= p.H).astype(float)),
    Statistic(
        "tau_diverged",
        "τ·1{τ ≤ H}",
        lambda p: np.where(p.tau <= p.H, p.tau, 0).astype(float),
    ),
    Statistic("exposure", "(H − τ)+ / H", lambda p: np.clip(p.H - p.tau, 0, None) / p.H),
    Statistic(
        "post_mismatch",
        "(1/H) Σ_{t>τ} I_t",
        lambda p: (p.mismatch & p.after_tau).sum(1) / p.H,
    ),
    Statistic("rollout_tv", "(1/H) Σ_t δ_t", lambda p: p.delta.mean(1)),
    Statistic("fixed_tv", "(1/H) Σ_t f_t", lambda p: p.fixed.mean(1)),
    Statistic(
        "saturation",
        "(1/H) Σ_t 1{δ_t > threshold}",
        lambda p: (p.delta > p.clock.saturation).sum(1) / p.H,
    ),
    Statistic("branch_cohort", "1{τ ≤ d}", lambda p: p.cohort.astype(float)),
    *(_segment(k) for k in range(4)),
    Statistic(
        "local_run",
        "1{τ ≤ d} · 1{≥ run consecutive agreements at τ < t < e}",
        lambda p: (p.cohort & (p.agreement[0] >= p.clock.agreement_run)).astype(float),
    ),
    Statistic(
        "local_reentry",
        "1{τ ≤ d} · 1{a mismatch at τ < t2 < e after an agreement at τ < t1 < t2}",
        lambda p: (p.cohort & p.agreement[1]).astype(float),
    ),
    Statistic(
        "prefix_mismatch",
        "(1/H) Σ_{t ≤ m} I_t, m = prediction prefix",
        lambda p: p.mismatch[:, : p.clock.prefix].sum(1) / p.H,
    ),
    Statistic("prefix_diverged", "1{τ ≤ m}", lambda p: (p.tau <= p.clock.prefix).astype(float)),
    Statistic("prefix_x_eos", "1{e_X ≤ m}", lambda p: (p.e_x <= p.clock.prefix).astype(float)),
    Statistic("prefix_y_eos", "1{e_Y ≤ m}", lambda p: (p.e_y <= p.clock.prefix).astype(float)),
    Statistic(
        "prefix_fixed",
        "(1/H) Σ_{t ≤ m} f_t",
        lambda p: p.fixed[:, : p.clock.prefix].sum(1) / p.H,
    ),
    Statistic(
        "div_cdf",
        "1{τ ≤ t}, t = 1..H",
        lambda p: (p.tau[:, None] <= p.steps[None, :]).astype(float),
        _steps,
    ),
    Statistic("delta", "δ_t, t = 1..H", lambda p: p.delta, _steps),
    Statistic("branch", "1{τ ≤ d} δ_{τ+j}, j = 1..d", lambda p: p.branch_delta, _lags),
    Statistic(
        "branch_pre", "1{τ ≤ d, τ+j < e} δ_{τ+j}", lambda p: p.branch_delta * p.pre_eos, _lags
    ),
    Statistic("branch_pre_n", "1{τ ≤ d, τ+j < e}", lambda p: p.pre_eos.astype(float), _lags),
)

STATISTICS: dict[str, Statistic] = {s.column: s for s in _BUILTIN}
"""Every document-level statistic by column (a profile by its stem), in column order."""


def register_statistic(statistic: Statistic) -> Statistic:
    """Add ``statistic`` to :data:`STATISTICS` (its columns follow the others'); a column
    already registered, or a name with ``@``, is refused in one line."""
    if statistic.column in STATISTICS:
        raise ValueError(f"statistic {statistic.column!r} is already registered")
    if "@" in statistic.column or not statistic.column:
        raise ValueError(f"statistic {statistic.column!r}: a column is a name without '@'")
    STATISTICS[statistic.column] = statistic
    return statistic


def statistic_columns(clock: Clock) -> list[str]:
    """Every statistic's columns for ``clock``, in registry order."""
    return [c for s in STATISTICS.values() for c in s.columns(clock)]
