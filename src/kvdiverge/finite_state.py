"""Finite-state autoregressive kernel pairs: coupled rollouts, exact DP, naive and SWRB estimators.

SPEC §4 (paper §4.4). A finite-state kernel pair has S history states and a vocabulary of V
tokens; history enters the kernels only through the state, so P_t(·|X_<t) = P[x_t] and
Q_t(·|Y_<t) = Q[y_t], where x_t (y_t) is the state reached from ``init_state`` by the tokens
X_<t (Y_<t) through the shared ``transition`` table. The reference chain X and the intervention
chain Y each carry their own state. EOS is absorbing (SPEC §1): emitting the ``eos`` token moves
a chain to a state whose kernels are the point mass on EOS and which EOS maps to itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvdiverge.coupling import Stream, crn_uniforms, maximal_coupling_step, tv

__all__ = [
    "FiniteStateKernelPair",
    "coupled_rollouts",
    "family",
    "family_parameters",
]

_ROW_SUM_TOL = 1e-9


def _fail(field: str, expected: str) -> None:
    raise ValueError(f"FiniteStateKernelPair.{field}: {expected}")


@dataclass(frozen=True)
class FiniteStateKernelPair:
    """A pair of finite-state next-token kernels (SPEC §1, §4 finite-state study).

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
    """Stepwise maximal coupling Γ(P, Q) run for H steps on ``n_paths`` paths (SPEC §1, §6).

    Each step uses the accept sampler of ``kvdiverge.coupling.maximal_coupling_step`` with common
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


# --------------------------------------------------------------------------------------------
# The §4.4 family
# --------------------------------------------------------------------------------------------

FAMILY_KEYS = (
    "n_systems",
    "horizon",
    "n_states",
    "n_tokens",
    "eos_prob",
    "dirichlet_alpha",
    "alt_strength",
)


def _family_section(config: Mapping[str, Any]) -> tuple[int, Mapping[str, Any]]:
    if "seed" not in config or "finite_state" not in config:
        raise ValueError(
            "config: expected the validated configuration with keys 'seed' and 'finite_state'"
        )
    section = config["finite_state"]
    missing = [k for k in FAMILY_KEYS if k not in section]
    if missing:
        raise ValueError(
            f"config.finite_state.{missing[0]}: missing (validate the config against "
            "workflow/schemas/config.schema.yaml, which fills the defaults)"
        )
    return int(config["seed"]), section


def family_parameters(config: Mapping[str, Any]) -> list[dict[str, float]]:
    """The mixing weights of the §4.4 family (SPEC §4): one dict per system.

    System c = 0..n−1 has λ = (0.05 + 0.45 c/(n−1))·U·V with U ~ Unif[0.5, 1], V ~ Unif[0, 1]
    (the paper's n = 25 gives its c/24). Keys: ``system``, ``c``, ``U``, ``V``, ``lambda``.
    """
    seed, section = _family_section(config)
    n = int(section["n_systems"])
    rng = np.random.default_rng([seed, 0x4_4])
    u = rng.uniform(0.5, 1.0, size=n)
    v = rng.uniform(0.0, 1.0, size=n)
    c = np.arange(n)
    lam = (0.05 + 0.45 * c / max(n - 1, 1)) * u * v
    return [
        {
            "system": int(i),
            "c": int(c[i]),
            "U": float(u[i]),
            "V": float(v[i]),
            "lambda": float(lam[i]),
        }
        for i in range(n)
    ]


def random_machine(
    rng: np.random.Generator,
    n_states: int,
    n_tokens: int,
    eos_prob: float,
    dirichlet_alpha: float,
) -> tuple[np.ndarray, np.ndarray, int | None]:
    """A random reference kernel on a random finite-state machine (SPEC §4 finite-state study).

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


def family(config: Mapping[str, Any]) -> list[FiniteStateKernelPair]:
    """The finite-state family of SPEC §4 (paper §4.4): Q = (1 − λ)P + λA per system.

    ``config`` is the validated configuration (keys ``seed`` and ``finite_state``). Each system
    has its own random machine and reference P (:func:`random_machine`) and an alternative
    A = (1 − κ)P + κD on live states, D a Dirichlet(``dirichlet_alpha``) draw over all tokens and
    κ = ``alt_strength``; absorbing EOS rows of A stay the point mass. λ comes from
    :func:`family_parameters`. Small κ makes divergence within the horizon rare.
    """
    seed, section = _family_section(config)
    n_states = int(section["n_states"])
    n_tokens = int(section["n_tokens"])
    eos_prob = float(section["eos_prob"])
    alpha = float(section["dirichlet_alpha"])
    kappa = float(section["alt_strength"])
    pairs = []
    for params in family_parameters(config):
        rng = np.random.default_rng([seed, 0x4_4, 1 + params["system"]])
        P, trans, eos = random_machine(rng, n_states, n_tokens, eos_prob, alpha)
        D = rng.dirichlet(np.full(n_tokens, alpha), size=P.shape[0])
        A = P.copy()
        A[:n_states] = (1 - kappa) * P[:n_states] + kappa * D[:n_states]
        lam = params["lambda"]
        Q = (1 - lam) * P + lam * A
        pairs.append(FiniteStateKernelPair(P=P, Q=Q, transition=trans, init_state=0, eos=eos))
    return pairs
