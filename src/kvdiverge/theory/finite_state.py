"""Finite-state autoregressive kernel pairs: coupled rollouts, exact DP, naive and SWRB estimators.

`docs/method.md`, "Survival-weighted residual branching". A finite-state kernel pair has S
history states and a vocabulary of V tokens; history enters the kernels only through the state,
so P_t(·|X_<t) = P[x_t] and Q_t(·|Y_<t) = Q[y_t], where x_t (y_t) is the state reached from
``init_state`` by the tokens X_<t (Y_<t) through the shared ``transition`` table. The reference
chain X and the intervention chain Y each carry their own state. EOS is absorbing ("End of
sequence"): emitting the ``eos`` token moves a chain to a state whose kernels are the point mass
on EOS and which EOS maps to itself.

Namesake: :mod:`kvdiverge.plots.finite_state` draws the finite-state study's figures from what
this module computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvdiverge.theory.coupling import (
    Stream,
    crn_uniforms,
    inverse_cdf,
    maximal_coupling_joint,
    maximal_coupling_step,
    tv,
)
from kvdiverge.theory.identification import observed_contribution, unobserved_capacity
from kvdiverge.theory.survival import survival_weights

__all__ = [
    "BranchReplicates",
    "ExactRisk",
    "FiniteStateKernelPair",
    "coupled_rollouts",
    "exact_risk",
    "hoeffding_halfwidth",
    "identified_interval_estimate",
    "naive_replicates",
    "random_machine",
    "swrb_replicates",
    "swrb_weight_bound",
]

_ROW_SUM_TOL = 1e-9


def _fail(field: str, expected: str) -> None:
    raise ValueError(f"FiniteStateKernelPair.{field}: {expected}")


@dataclass(frozen=True)
class FiniteStateKernelPair:
    """A pair of finite-state next-token kernels.

    ``P[s]`` and ``Q[s]`` are the reference and intervention next-token distributions in history
    state ``s`` (shape ``(S, V)``); ``transition[s, v]`` is the state after emitting token ``v``
    in state ``s``; ``init_state`` is the state of the empty history; ``eos`` is the absorbing
    EOS token or ``None``. Arrays are copied to read-only float64/int64 arrays on construction,
    and the pair validates itself with one-line errors naming the field.
    """

    P: np.ndarray
    Q: np.ndarray
    transition: np.ndarray
    init_state: int
    eos: int | None = None

    def __post_init__(self) -> None:
        p = np.array(self.P, dtype=np.float64)
        q = np.array(self.Q, dtype=np.float64)
        if p.ndim != 2 or p.shape[0] < 1 or p.shape[1] < 1:
            _fail("P", f"expected a non-empty 2-D array (S, V), got shape {p.shape}")
        if q.shape != p.shape:
            _fail("Q", f"expected shape {p.shape} like P, got {q.shape}")
        n_states, n_tokens = p.shape
        for name, a in (("P", p), ("Q", q)):
            if not np.all(np.isfinite(a)) or (a < 0).any():
                _fail(name, "expected finite non-negative probabilities")
            bad = np.flatnonzero(np.abs(a.sum(1) - 1.0) > _ROW_SUM_TOL)
            if bad.size:
                _fail(name, f"row {bad[0]} sums to {a[bad[0]].sum():.12g}, expected 1")
        raw_t = np.asarray(self.transition)
        if raw_t.shape != p.shape:
            _fail("transition", f"expected shape {p.shape} like P, got {raw_t.shape}")
        if not np.issubdtype(raw_t.dtype, np.integer):
            _fail("transition", f"expected an integer array, got dtype {raw_t.dtype}")
        trans = raw_t.astype(np.int64)
        if (trans < 0).any() or (trans >= n_states).any():
            _fail(
                "transition",
                f"expected states in [0, {n_states}), got {trans.min()}..{trans.max()}",
            )
        init = self.init_state
        if isinstance(init, bool) or not isinstance(init, int | np.integer):
            _fail("init_state", f"expected an int, got {init!r}")
        if not 0 <= int(init) < n_states:
            _fail("init_state", f"expected a state in [0, {n_states}), got {init}")
        eos = self.eos
        if eos is not None:
            if isinstance(eos, bool) or not isinstance(eos, int | np.integer):
                _fail("eos", f"expected an int or None, got {eos!r}")
            if not 0 <= int(eos) < n_tokens:
                _fail("eos", f"expected a token in [0, {n_tokens}), got {eos}")
            point_mass = np.zeros(n_tokens)
            point_mass[eos] = 1.0
            for a in np.unique(trans[:, eos]):
                if not (np.array_equal(p[a], point_mass) and np.array_equal(q[a], point_mass)):
                    _fail(
                        "eos",
                        f"state {a} reached by EOS must be absorbing: P[{a}] and Q[{a}] must be "
                        f"the point mass on token {eos}",
                    )
                if trans[a, eos] != a:
                    _fail("transition", f"absorbing EOS state {a} must map EOS to itself")
            eos = int(eos)
        for a in (p, q, trans):
            a.setflags(write=False)
        object.__setattr__(self, "P", p)
        object.__setattr__(self, "Q", q)
        object.__setattr__(self, "transition", trans)
        object.__setattr__(self, "init_state", int(init))
        object.__setattr__(self, "eos", eos)

    @property
    def n_states(self) -> int:
        """Number of history states S (including absorbing EOS states)."""
        return self.P.shape[0]

    @property
    def n_tokens(self) -> int:
        """Vocabulary size V."""
        return self.P.shape[1]

    def absorbing_states(self) -> np.ndarray:
        """Boolean mask (S,) of absorbing EOS states (all False without EOS)."""
        mask = np.zeros(self.n_states, dtype=bool)
        if self.eos is not None:
            mask[np.unique(self.transition[:, self.eos])] = True
        return mask


def coupled_rollouts(
    pair: FiniteStateKernelPair,
    H: int,
    n_paths: int,
    seed: int,
    document: int | str = 0,
    salt: int = 0,
) -> dict[str, np.ndarray]:
    """Stepwise maximal coupling Γ(P, Q) run for H steps on ``n_paths`` paths.

    Each step uses the accept sampler of ``kvdiverge.theory.coupling.maximal_coupling_step`` with
    common
    random numbers keyed by (seed, document, replicate = path, step = t, stream) for the
    ``REFERENCE``, ``ACCEPT`` and ``RESIDUAL`` streams (``salt`` separates further families).
    Vectorized over paths; loops over t only. Returns (n_paths, H) arrays: ``x``, ``y`` tokens,
    ``mismatch`` I_t, ``tv_rollout`` δ_t = TV(P[x_state], Q[y_state]), ``tv_fixed``
    f_t = TV(P[x_state], Q[x_state]), ``x_eos``/``y_eos`` (EOS emitted at or before t).
    """
    _check_positive_int("H", H)
    _check_positive_int("n_paths", n_paths)
    paths = np.arange(n_paths)
    x_state = np.full(n_paths, pair.init_state, dtype=np.int64)
    y_state = x_state.copy()
    out = {
        "x": np.empty((n_paths, H), dtype=np.int64),
        "y": np.empty((n_paths, H), dtype=np.int64),
        "tv_rollout": np.empty((n_paths, H)),
        "tv_fixed": np.empty((n_paths, H)),
    }
    streams = (Stream.REFERENCE, Stream.ACCEPT, Stream.RESIDUAL)
    for t in range(1, H + 1):
        u = np.stack([crn_uniforms(seed, document, paths, t, s, salt) for s in streams], axis=-1)
        p, q = pair.P[x_state], pair.Q[y_state]
        x, y = maximal_coupling_step(p, q, u, sampler="accept")
        out["x"][:, t - 1] = x
        out["y"][:, t - 1] = y
        out["tv_rollout"][:, t - 1] = tv(p, q)
        out["tv_fixed"][:, t - 1] = tv(p, pair.Q[x_state])
        x_state = pair.transition[x_state, x]
        y_state = pair.transition[y_state, y]
    out["mismatch"] = out["x"] != out["y"]
    if pair.eos is None:
        out["x_eos"] = np.zeros((n_paths, H), dtype=bool)
        out["y_eos"] = np.zeros((n_paths, H), dtype=bool)
    else:
        out["x_eos"] = np.logical_or.accumulate(out["x"] == pair.eos, axis=1)
        out["y_eos"] = np.logical_or.accumulate(out["y"] == pair.eos, axis=1)
    return out


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")


def random_machine(
    rng: np.random.Generator,
    n_states: int,
    n_tokens: int,
    eos_prob: float,
    dirichlet_alpha: float,
) -> tuple[np.ndarray, np.ndarray, int | None]:
    """A random reference kernel on a random finite-state machine.

    Live states 0..n_states−1 (0 is the empty history) move to a uniformly drawn live state on
    each non-EOS token; with ``eos_prob > 0`` token V−1 is EOS and leads to the absorbing state
    n_states. Live rows of P put ``eos_prob`` on EOS and a Dirichlet(``dirichlet_alpha``) draw,
    scaled by 1 − eos_prob, on the other tokens. Returns ``(P, transition, eos)``.
    """
    has_eos = eos_prob > 0
    n_words = n_tokens - 1 if has_eos else n_tokens
    if n_words < 2:
        raise ValueError(f"n_tokens: expected at least {3 if has_eos else 2}, got {n_tokens}")
    total = n_states + 1 if has_eos else n_states
    P = np.zeros((total, n_tokens))
    trans = np.zeros((total, n_tokens), dtype=np.int64)
    P[:n_states, :n_words] = (1 - eos_prob) * rng.dirichlet(
        np.full(n_words, dirichlet_alpha), size=n_states
    )
    trans[:n_states, :n_words] = rng.integers(0, n_states, size=(n_states, n_words))
    eos = None
    if has_eos:
        eos = n_tokens - 1
        P[:n_states, eos] = eos_prob
        P[n_states, eos] = 1.0
        trans[:, eos] = n_states
        trans[n_states, :] = n_states
    return P, trans, eos


# --------------------------------------------------------------------------------------------
# Exact dynamic programming over the coupled chain
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExactRisk:
    """Exact divergence-timing quantities of a kernel pair over horizon H.

    ``p[s-1]`` = p_s = P(τ = s); ``rho[s-1, j]`` = ρ_{s,j} = P(I_{s+j} = 1 | τ = s) for
    0 ≤ j ≤ H − s (ρ_{s,0} = 1; entries with p_s = 0 or j > H − s are 0); ``mismatch`` holds
    E[I_t] for t = 1..H. Scalars: R_SMC, O_H, Π_H, E_H, C_H (C_H is NaN when E_H = 0).
    """

    H: int
    p: np.ndarray
    rho: np.ndarray
    mismatch: np.ndarray
    R_smc: float
    O_H: float
    Pi_H: float
    E_H: float
    C_H: float

    @property
    def divergence_probability(self) -> float:
        """P(τ ≤ H) = Σ_s p_s (= H·O_H), the mean of SWRB's M."""
        return float(self.p.sum())

    def R_L(self, L: int) -> float:
        """Observed contribution R_L = (1/H) Σ_s p_s Σ_{j<ℓ_s} ρ_{s,j}."""
        return float(observed_contribution(self.p, self.rho, self.H, L))

    def B_L(self, L: int) -> float:
        """Unobserved capacity B_L = (1/H) Σ_s p_s (H − s + 1 − ℓ_s)."""
        return float(unobserved_capacity(self.p, self.H, L))


def _pair_operators(
    pair: FiniteStateKernelPair,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Coupled-chain operators from the stepwise maximal-coupling joint laws.

    Returns ``(agree, enter, K, delta)``: ``agree[s, s']`` the probability of agreeing and moving
    s → s'; ``enter[s, x'·S + y']`` the probability of diverging in agreed state s and landing in
    state pair (x', y'); ``K`` the (S², S²) one-step operator on state pairs; ``delta[x·S + y]``
    = TV(P[x], Q[y]) = P(I_t = 1 | states (x, y)).
    """
    S, V = pair.n_states, pair.n_tokens
    T = pair.transition
    K = np.zeros((S * S, S * S))
    agree = np.zeros((S, S))
    enter = np.zeros((S, S * S))
    delta = np.empty(S * S)
    off_diagonal = ~np.eye(V, dtype=bool)
    for x in range(S):
        for y in range(S):
            joint = maximal_coupling_joint(pair.P[x], pair.Q[y])
            target = T[x][:, None] * S + T[y][None, :]
            np.add.at(K[x * S + y], target, joint)
            delta[x * S + y] = tv(pair.P[x], pair.Q[y])
            if x == y:
                np.add.at(agree[x], T[x], np.diag(joint))
                np.add.at(enter[x], target[off_diagonal], joint[off_diagonal])
    return agree, enter, K, delta


def exact_risk(pair: FiniteStateKernelPair, H: int) -> ExactRisk:
    """Exact R_SMC, O_H, Π_H, E_H, C_H, p_s and the full ρ by DP over the coupled chain.

    Before divergence both chains share one state; at step t the agreed mass in state s
    diverges with probability e_s = TV(P[s], Q[s]) into the state pairs given by the
    off-diagonal of the maximal-coupling joint law; after divergence the law of the state pair
    (x, y) evolves by the one-step operator K, and E[I_t | x, y] = TV(P[x], Q[y]).
    One propagation per entry time s gives E[I_{s+j} 1{τ = s}] for every j ≤ H − s.
    """
    _check_positive_int("H", H)
    S = pair.n_states
    agree, enter, K, delta = _pair_operators(pair)
    e_agreed = delta[np.arange(S) * S + np.arange(S)]
    mass = np.zeros(S)
    mass[pair.init_state] = 1.0
    p = np.empty(H)
    branch = np.zeros((H, S * S))  # law of the state pair just after divergence at step s
    for t in range(H):
        p[t] = mass @ e_agreed
        branch[t] = mass @ enter
        mass = mass @ agree
    # joint[s-1, j] = E[I_{s+j} 1{τ = s}] for j ≥ 1 (j = 0 is p_s)
    joint = np.zeros((H, H))
    joint[:, 0] = p
    current = branch
    for j in range(1, H):
        joint[: H - j, j] = current[: H - j] @ delta
        current = current[: H - j - 1] @ K
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = np.where(p[:, None] > 0, joint / np.where(p > 0, p, 1.0)[:, None], 0.0)
    s_idx = np.arange(H)[:, None]
    j_idx = np.arange(H)[None, :]
    diag_index = s_idx + j_idx  # t − 1 for entry s and lag j
    mismatch = np.bincount(diag_index[diag_index < H], weights=joint[diag_index < H], minlength=H)
    R = float(mismatch.sum() / H)
    O = float(p.sum() / H)
    post = float(joint[:, 1:].sum() / H)
    exposure = float((p * (H - np.arange(1, H + 1))).sum() / H)
    C = post / exposure if exposure > 0 else float("nan")
    return ExactRisk(
        H=H, p=p, rho=rho, mismatch=mismatch, R_smc=R, O_H=O, Pi_H=post, E_H=exposure, C_H=C
    )


# --------------------------------------------------------------------------------------------
# Estimators: naive rollouts and Survival-Weighted Residual Branching
# --------------------------------------------------------------------------------------------

NAIVE_SALT = 0
SWRB_SALT = 1


@dataclass(frozen=True)
class BranchReplicates:
    """Per-replicate output of a branch estimator, naive or SWRB.

    ``weight`` (n,): the factor in front of the branch — 1 for a naive rollout, M = P(τ ≤ H | U)
    for SWRB; ``entry`` (n,): the branch entry time (τ for naive, J for SWRB; H + 1 when there is
    no branch); ``mismatch`` (n, H): I_t of the sampled trajectory (zero before ``entry``);
    ``cost`` (n,): kernel-pair evaluations spent. Every estimator below is
    ``weight × (a statistic of the branch)``, so the same methods serve both samplers.
    """

    H: int
    weight: np.ndarray
    entry: np.ndarray
    mismatch: np.ndarray
    cost: np.ndarray

    @property
    def n(self) -> int:
        """Number of replicates."""
        return self.weight.shape[0]

    def _has_branch(self) -> np.ndarray:
        return self.entry <= self.H

    def Z_R(self) -> np.ndarray:
        """Z^R = M·D_J for SWRB, B·D_H for naive: unbiased for R_SMC."""
        return self.weight * self.mismatch.sum(1) / self.H

    def Z_O(self) -> np.ndarray:
        """Z^O = M/H for SWRB, 1{τ ≤ H}/H for naive: unbiased for O_H."""
        return self.weight * self._has_branch() / self.H

    def Z_Pi(self) -> np.ndarray:
        """Z^Π = M(D_J − 1/H) for SWRB, B(D_H − 1/H) for naive: unbiased for Π_H."""
        return self.Z_R() - self.Z_O()

    def Z_L(self, L: int) -> np.ndarray:
        """Z_L = M·(1/H) Σ_{j<ℓ_J} I_{J+j}: unbiased for R_L."""
        _check_positive_int("L", L)
        t = np.arange(1, self.H + 1)[None, :]
        start = self.entry[:, None]
        inside = (t >= start) & (t < start + L)
        return self.weight * (self.mismatch & inside).sum(1) / self.H

    def W_L(self, L: int) -> np.ndarray:
        """W_L = M·(H − J + 1 − ℓ_J)/H: unbiased for B_L."""
        _check_positive_int("L", L)
        remaining = np.clip(self.H - self.entry + 1, 0, None)
        return self.weight * (remaining - np.minimum(L, remaining)) / self.H


def naive_replicates(
    pair: FiniteStateKernelPair,
    H: int,
    n_reps: int,
    seed: int,
    document: int | str = 0,
    salt: int = NAIVE_SALT,
) -> BranchReplicates:
    """Naive estimator: one full coupled rollout per replicate, B·D_H.

    Cost: one kernel-pair evaluation per step at which at least one chain is outside the
    absorbing EOS states (H per rollout without EOS); once both have emitted EOS the rest of the
    rollout is known (I_t = 0) and needs no evaluation.
    """
    r = coupled_rollouts(pair, H, n_reps, seed, document, salt=salt)
    mismatch = r["mismatch"]
    entry = np.where(mismatch.any(1), mismatch.argmax(1) + 1, H + 1)
    both_absorbed_before = np.zeros((n_reps, H), dtype=bool)
    both_absorbed_before[:, 1:] = (r["x_eos"] & r["y_eos"])[:, :-1]
    cost = (~both_absorbed_before).sum(1)
    return BranchReplicates(H=H, weight=np.ones(n_reps), entry=entry, mismatch=mismatch, cost=cost)


def swrb_replicates(
    pair: FiniteStateKernelPair,
    H: int,
    n_reps: int,
    seed: int,
    document: int | str = 0,
    salt: int = SWRB_SALT,
) -> BranchReplicates:
    """Survival-Weighted Residual Branching, vectorized over replicates.

    1. Overlap scan: U_s ~ c_s/(1 − e_s) on the agreed history, by inverse CDF at the
       ``SWRB_SCAN`` stream. The scan stops early where e_s = 1 (K∩ undefined, later weights 0)
       and where U enters an absorbing EOS state (from there on e_s = 0 exactly).
    2. w_s = e_s Π_{r<s}(1 − e_r), M = Σ_s w_s.
    3. J ~ w/M by inverse CDF at the ``SWRB_ENTRY`` stream; the residual pair at J:
       X_J ~ (p − c)/e (``REFERENCE`` stream, step J), Y_J ~ (q − c)/e (``RESIDUAL`` stream);
       then the stepwise maximal coupling (accept sampler, streams ``REFERENCE``, ``ACCEPT``,
       ``RESIDUAL`` at steps J+1..H) continues to H.

    Cost = scan steps evaluated + continuation steps J+1..H at which at least one chain is
    outside the absorbing EOS states (the residual pair at J reuses the scan's evaluation).
    """
    _check_positive_int("H", H)
    _check_positive_int("n_reps", n_reps)
    reps = np.arange(n_reps)
    absorbing = pair.absorbing_states()
    T = pair.transition
    state = np.full(n_reps, pair.init_state, dtype=np.int64)
    scanning = np.ones(n_reps, dtype=bool)
    e = np.zeros((n_reps, H))
    scan_states = np.empty((n_reps, H), dtype=np.int64)
    scan_cost = np.zeros(n_reps, dtype=np.int64)
    for t in range(1, H + 1):
        scanning &= ~absorbing[state]
        scan_cost += scanning
        scan_states[:, t - 1] = state
        overlap = np.minimum(pair.P[state], pair.Q[state])
        e_t = np.clip(1.0 - overlap.sum(1), 0.0, 1.0)
        e[:, t - 1] = np.where(scanning, e_t, 0.0)
        u = crn_uniforms(seed, document, reps, t, Stream.SWRB_SCAN, salt)
        token = inverse_cdf(overlap, u)
        scanning &= e_t < 1.0
        state = np.where(scanning, T[state, token], state)
    w, M = survival_weights(e)
    has_branch = M > 0
    u_entry = crn_uniforms(seed, document, reps, 0, Stream.SWRB_ENTRY, salt)
    entry = np.where(has_branch, inverse_cdf(w, u_entry) + 1, H + 1)
    # residual pair at J
    j_idx = np.clip(entry, 1, H) - 1
    s_entry = scan_states[reps, j_idx]
    p, q = pair.P[s_entry], pair.Q[s_entry]
    overlap = np.minimum(p, q)
    x_res = inverse_cdf(
        np.clip(p - overlap, 0, None),
        crn_uniforms(seed, document, reps, j_idx + 1, Stream.REFERENCE, salt),
    )
    y_res = inverse_cdf(
        np.clip(q - overlap, 0, None),
        crn_uniforms(seed, document, reps, j_idx + 1, Stream.RESIDUAL, salt),
    )
    mismatch = np.zeros((n_reps, H), dtype=bool)
    mismatch[reps, j_idx] = has_branch
    x_state, y_state = T[s_entry, x_res], T[s_entry, y_res]
    continuation_cost = np.zeros(n_reps, dtype=np.int64)
    streams = (Stream.REFERENCE, Stream.ACCEPT, Stream.RESIDUAL)
    for t in range(2, H + 1):
        going = has_branch & (entry < t)
        if not going.any():
            continue
        continuation_cost += going & ~(absorbing[x_state] & absorbing[y_state])
        u = np.stack([crn_uniforms(seed, document, reps, t, s, salt) for s in streams], axis=-1)
        x, y = maximal_coupling_step(pair.P[x_state], pair.Q[y_state], u, sampler="accept")
        mismatch[:, t - 1] |= going & (x != y)
        x_state = np.where(going, T[x_state, x], x_state)
        y_state = np.where(going, T[y_state, y], y_state)
    return BranchReplicates(
        H=H, weight=M, entry=entry, mismatch=mismatch, cost=scan_cost + continuation_cost
    )


def hoeffding_halfwidth(n: int, value_range: float, alpha: float) -> float:
    """Hoeffding half-width for the mean of n values in an interval of length ``value_range``.

    P(|mean − E| ≥ h) ≤ α for h = range·sqrt(log(2/α)/(2n)) (used by the SWRB window bounds).
    """
    _check_positive_int("n", n)
    if not 0 < alpha < 1:
        raise ValueError(f"alpha: expected a value in (0, 1), got {alpha!r}")
    return float(value_range * np.sqrt(np.log(2.0 / alpha) / (2.0 * n)))


def identified_interval_estimate(
    reps: BranchReplicates, L: int, alpha: float = 0.05, weight_bound: float = 1.0
) -> dict[str, float]:
    """Estimates of the identified interval [R_L, R_L + B_L] with Hoeffding bounds.

    The lower endpoint R_L is the mean of Z_L ∈ [0, m·min(L, H)/H]; the upper endpoint R_L + B_L
    the mean of Z_L + W_L ∈ [0, m], where m = ``weight_bound`` is a deterministic upper bound on
    the weight M (1 always works; :func:`swrb_weight_bound` is tighter for a known kernel pair).
    Each endpoint gets a two-sided Hoeffding interval at level α/2, so that both hold jointly with
    probability ≥ 1 − α (Bonferroni); intervals are clipped to the range of the mean.
    """
    if not 0 < weight_bound <= 1:
        raise ValueError(f"weight_bound: expected a value in (0, 1], got {weight_bound!r}")
    if reps.weight.max(initial=0.0) > weight_bound + 1e-12:
        raise ValueError(
            f"weight_bound: {weight_bound!r} is below a sampled weight {reps.weight.max()!r}"
        )
    z_l = reps.Z_L(L)
    upper = z_l + reps.W_L(L)
    low_range = weight_bound * min(L, reps.H) / reps.H
    h_low = hoeffding_halfwidth(reps.n, low_range, alpha / 2)
    h_high = hoeffding_halfwidth(reps.n, weight_bound, alpha / 2)
    low, high = float(z_l.mean()), float(upper.mean())
    return {
        "R_L": low,
        "R_L_lo": max(low - h_low, 0.0),
        "R_L_hi": min(low + h_low, low_range),
        "upper": high,
        "upper_lo": max(high - h_high, 0.0),
        "upper_hi": min(high + h_high, weight_bound),
    }


def swrb_weight_bound(pair: FiniteStateKernelPair, H: int) -> float:
    """Deterministic bound on SWRB's weight: M = 1 − Π_s (1 − e_s) ≤ 1 − (1 − max_z e(z))^H.

    e(z) = TV(P[z], Q[z]) over all states z, so the bound holds for every overlap scan.
    """
    _check_positive_int("H", H)
    e_max = float(tv(pair.P, pair.Q).max())
    return float(min(1.0, 1.0 - (1.0 - e_max) ** H)) if e_max < 1 else 1.0
