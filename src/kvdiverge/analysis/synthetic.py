"""Finite-state trajectory studies with known answers, in the trajectory Parquet schema.

A synthetic study gives each stratum one random finite-state machine with a reference kernel P
(:func:`kvdiverge.theory.finite_state.random_machine`) and each action an intervention
Q_a = (1 − λ_a) P + λ_a A (the finite-state family's form; λ = 0 is the full-retention control).
Documents of a stratum are independent replicates of its kernel pair, so every estimand has an
exact value. Rollouts use :func:`kvdiverge.theory.finite_state.coupled_rollouts` with common random
numbers keyed by (seed, stratum/cohort, replicate, t): every action replays the same reference
path X (`docs/method.md`, "Common random numbers").

Exact values (:func:`exact_statistic_means`) are the expectations of every per-document
statistic of :mod:`kvdiverge.analysis.document_stats`; passing them through
:func:`kvdiverge.analysis.estimands.action_estimands` gives the exact estimands.

* by exact dynamic programming: D_H, 1{τ ≤ H}, τ·1{τ ≤ H}, exposure, post-divergence mismatches,
  R, F, saturation, P(τ ≤ t), E[δ_t], the branch cohort and E[1{τ ≤ d} δ_{τ+j}], and the prefix
  features (via :func:`kvdiverge.theory.finite_state.exact_risk` and the law of the state pair);
* by a very large Monte Carlo sample (default 400,000 paths): E[D_H²], the EOS segments of
  R − F, the pre-EOS branch sums and counts and the local-agreement indicators, which depend on
  EOS times and run lengths jointly with τ.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import polars as pl

from kvdiverge.analysis.document_stats import Clock, path_statistics, stat_columns
from kvdiverge.io import sha256_file, write_parquet_with_metadata
from kvdiverge.io.trajectories import write_trajectories
from kvdiverge.theory.coupling import tv
from kvdiverge.theory.finite_state import (
    FiniteStateKernelPair,
    _pair_operators,
    coupled_rollouts,
    exact_risk,
    random_machine,
)

__all__ = [
    "MONTE_CARLO_STATISTICS",
    "exact_statistic_means",
    "stratum_pairs",
    "synthetic_trajectories",
    "write_synthetic_study",
]

MONTE_CARLO_STATISTICS = ("mismatch_sq", "rf_seg", "branch_pre", "local_")


def stratum_pairs(
    seed: int,
    lambdas: Mapping[str, float],
    n_states: int = 6,
    n_tokens: int = 5,
    eos_prob: float = 0.02,
    dirichlet_alpha: float = 0.5,
    alt_strength: float = 1.0,
) -> dict[str, FiniteStateKernelPair]:
    """One stratum's kernel pairs: Q_a = (1 − λ_a) P + λ_a A per action (family form).

    All actions share the machine and P (so common random numbers replay the same X); A mixes P
    with a Dirichlet draw, A = (1 − κ)P + κD, κ = ``alt_strength``, on live states. λ_a = 0
    gives Q = P, the full-retention control (δ ≡ 0).
    """
    rng = np.random.default_rng(seed)
    P, trans, eos = random_machine(rng, n_states, n_tokens, eos_prob, dirichlet_alpha)
    D = rng.dirichlet(np.full(n_tokens, dirichlet_alpha), size=P.shape[0])
    A = P.copy()
    A[:n_states] = (1 - alt_strength) * P[:n_states] + alt_strength * D[:n_states]
    return {
        action: FiniteStateKernelPair(
            P=P, Q=(1 - lam) * P + lam * A, transition=trans, init_state=0, eos=eos
        )
        for action, lam in lambdas.items()
    }


def synthetic_trajectories(
    pair: FiniteStateKernelPair,
    doc_ids: list[str],
    K: int,
    H: int,
    seed: int,
    key: str,
    n_prompt: int = 100,
) -> pl.DataFrame:
    """Coupled rollouts of ``pair`` for ``doc_ids`` × K replicates as a trajectory table.

    Path r of the batch is document ``doc_ids[r // K]``, replicate ``r % K``; uniforms are keyed
    by (seed, ``key``, r, t), so actions sharing P and ``key`` share X.
    """
    n = len(doc_ids) * K
    r = coupled_rollouts(pair, H, n, seed, document=key)
    paths = np.arange(n)
    return pl.DataFrame(
        {
            "doc_id": np.repeat(np.asarray(doc_ids, dtype=object)[paths // K], H).tolist(),
            "replicate": np.repeat(paths % K, H).astype(np.int32),
            "t": np.tile(np.arange(1, H + 1), n).astype(np.int16),
            "x_token": r["x"].ravel().astype(np.int32),
            "y_token": r["y"].ravel().astype(np.int32),
            "mismatch": r["mismatch"].ravel(),
            "tv_rollout": r["tv_rollout"].ravel().astype(np.float32),
            "tv_fixed": r["tv_fixed"].ravel().astype(np.float32),
            "x_eos": r["x_eos"].ravel(),
            "y_eos": r["y_eos"].ravel(),
            "n_prompt": np.full(n * H, n_prompt, dtype=np.int32),
            "n_kept": np.full(n * H, n_prompt // 2, dtype=np.int32),
        }
    )


def write_synthetic_study(
    root: str | os.PathLike,
    study: str,
    model: str,
    strata_pairs: Mapping[str, Mapping[str, FiniteStateKernelPair]],
    cohorts: Mapping[str, tuple[int, int]],
    H: int,
    seed: int,
    control: str | None = None,
    control_K: int = 2,
) -> dict[str, dict[str, Path]]:
    """Write a synthetic study under ``root`` in the pipeline's layout; return the files.

    ``strata_pairs[stratum][action]``: kernel pairs (e.g. from :func:`stratum_pairs`);
    ``cohorts[name] = (documents per stratum, K)``. Writes
    ``results/documents/{stratum}.parquet`` and
    ``results/{study}/{model}/trajectories/{action}/{stratum}.parquet``; the
    control action, if named, runs every document with ``control_K`` replicates. Returns
    ``{"documents": {stratum: path}, "<action>": {stratum: path}, ...}``.
    """
    root = Path(root)
    files: dict[str, dict[str, Path]] = {"documents": {}}
    for stratum, pairs in strata_pairs.items():
        env, _, length = stratum.partition("-")
        doc_rows = []
        for cohort, (n_docs, _) in cohorts.items():
            for i in range(n_docs):
                doc_rows.append(
                    {
                        "doc_id": f"{stratum}/{cohort}/{i:03d}",
                        "stratum": stratum,
                        "env": env,
                        "length_label": length,
                        "target_tokens": 100,
                        "task": "synthetic",
                        "cohort": cohort,
                        "prompt": "",
                        "answers": [],
                        "source": "kvdiverge.analysis.synthetic",
                        "seed": seed,
                    }
                )
        doc_path = root / "results" / "documents" / f"{stratum}.parquet"
        table = pl.DataFrame(doc_rows, schema_overrides={"answers": pl.List(pl.String)})
        write_parquet_with_metadata(table, doc_path, {"source": "kvdiverge.analysis.synthetic"})
        files["documents"][stratum] = doc_path
        documents = {"file": str(doc_path), "sha256": sha256_file(doc_path)}
        for action, pair in pairs.items():
            parts = []
            for cohort, (n_docs, K) in cohorts.items():
                ids = [f"{stratum}/{cohort}/{i:03d}" for i in range(n_docs)]
                k = control_K if action == control else K
                parts.append(synthetic_trajectories(pair, ids, k, H, seed, f"{stratum}/{cohort}"))
            path = root / "results" / study / model / "trajectories" / action / f"{stratum}.parquet"
            meta = {
                "model": model,
                "revision": "synthetic",
                "action": {"name": action},
                "H": H,
                "K": max(k for _, k in cohorts.values()),
                "seed": seed,
                "coupling": "shared-reference",
                "dtype": "float64",
                "device": "cpu",
                "documents": documents,
            }
            write_trajectories(pl.concat(parts), path, meta)
            files.setdefault(action, {})[stratum] = path
    return files


def _chain_law(kernel: np.ndarray, transition: np.ndarray, init: int, steps: int) -> np.ndarray:
    """Law of a single chain's state before steps 1..steps+1 (rows), kernel (S, V)."""
    n_states = kernel.shape[0]
    move = np.zeros((n_states, n_states))
    np.add.at(
        move, (np.repeat(np.arange(n_states), kernel.shape[1]), transition.ravel()), kernel.ravel()
    )
    law = np.zeros((steps + 1, n_states))
    law[0, init] = 1.0
    for t in range(steps):
        law[t + 1] = law[t] @ move
    return law


def exact_statistic_means(
    pair: FiniteStateKernelPair,
    clock: Clock,
    mc_paths: int = 400_000,
    seed: int = 0,
) -> dict[str, float]:
    """Expected value of every per-path statistic of ``document_stats`` for one kernel pair.

    Exact by dynamic programming where the module docstring says so, else by a Monte Carlo
    sample of ``mc_paths`` coupled rollouts (names starting with :data:`MONTE_CARLO_STATISTICS`).
    """
    h, d, m = clock.H, clock.branch_depth, clock.prefix
    risk = exact_risk(pair, h)
    s = np.arange(1, h + 1)
    n_states = pair.n_states
    _, _, pair_step, pair_tv = _pair_operators(pair)
    pair_law = np.zeros((h, n_states * n_states))
    pair_law[0, pair.init_state * n_states + pair.init_state] = 1.0
    for t in range(1, h):
        pair_law[t] = pair_law[t - 1] @ pair_step
    x_law = _chain_law(pair.P, pair.transition, pair.init_state, h)
    y_law = _chain_law(pair.Q, pair.transition, pair.init_state, h)
    fixed = x_law[:h] @ tv(pair.P, pair.Q)
    delta = pair_law @ pair_tv  # E[δ_t] from the law of the state pair
    absorbing = pair.absorbing_states()
    # joint[s-1, j] = E[I_{s+j} 1{τ=s}] = E[δ_{s+j} 1{τ=s}]
    joint = risk.rho * risk.p[:, None]

    exact: dict[str, float] = {
        "mismatch": risk.R_smc,
        "diverged": float(risk.p.sum()),
        "tau_diverged": float((s * risk.p).sum()),
        "exposure": risk.E_H,
        "post_mismatch": risk.Pi_H,
        "rollout_tv": float(delta.mean()),
        "fixed_tv": float(fixed.mean()),
        "saturation": float((pair_law @ (pair_tv > clock.saturation)).sum() / h),
        "branch_cohort": float(risk.p[:d].sum()),
        "prefix_mismatch": float(risk.mismatch[:m].sum() / h),
        "prefix_diverged": float(risk.p[:m].sum()),
        "prefix_x_eos": float(x_law[m, absorbing].sum()),
        "prefix_y_eos": float(y_law[m, absorbing].sum()),
        "prefix_fixed": float(fixed[:m].sum() / h),
    }
    cdf = np.cumsum(risk.p)
    for t in range(1, h + 1):
        exact[f"div_cdf@{t}"] = float(cdf[t - 1])
        exact[f"delta@{t}"] = float(delta[t - 1])
    for j in range(1, d + 1):
        exact[f"branch@{j}"] = float(joint[:d, j].sum())

    names = stat_columns(clock)
    r = coupled_rollouts(pair, h, mc_paths, seed, document="exact-monte-carlo")
    mc = path_statistics(
        r["mismatch"], r["tv_rollout"], r["tv_fixed"], r["x_eos"], r["y_eos"], clock
    ).mean(0)
    for i, name in enumerate(names):
        if name.startswith(MONTE_CARLO_STATISTICS):
            exact[name] = float(mc[i])
    return {name: exact[name] for name in names}
