"""The paper's finite-state study: its family of kernel pairs, the per-system table, the summary.

The machinery (kernel pairs, exact dynamic programming, the naive and SWRB estimators) lives in
:mod:`kvdiverge.theory.finite_state`; this module turns the validated ``finite_state`` section of
the
configuration into the family of systems and runs the study over it (`docs/method.md`,
"Survival-weighted residual branching"; the tables' columns in `docs/architecture.md`, "File
contracts").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import polars as pl

from kvdiverge.theory.finite_state import (
    FiniteStateKernelPair,
    exact_risk,
    identified_interval_estimate,
    naive_replicates,
    random_machine,
    swrb_replicates,
    swrb_weight_bound,
)

__all__ = ["FAMILY_KEYS", "family", "family_parameters", "study_summary", "study_tables"]

FAMILY_KEYS = (
    "n_systems",
    "horizon",
    "n_states",
    "n_tokens",
    "eos_prob",
    "dirichlet_alpha",
    "alt_strength",
    "n_reps",
    "window_depths",
    "alpha",
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
    if section["eos_prob"] > 0 and section["n_tokens"] < 3:
        raise ValueError(
            "config.finite_state.n_tokens: expected at least 3 when eos_prob > 0 "
            f"(two words and EOS), got {section['n_tokens']}"
        )
    shown = section.get("interval_figure_systems", [])  # figure-only: may be absent here
    too_large = [s for s in shown if s >= section["n_systems"]]
    if too_large:
        raise ValueError(
            "config.finite_state.interval_figure_systems: expected system indices < n_systems "
            f"({section['n_systems']}), got {too_large[0]}"
        )
    return int(config["seed"]), section


def family_parameters(config: Mapping[str, Any]) -> list[dict[str, float]]:
    """The mixing weights of the finite-state family: one dict per system.

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


def family(config: Mapping[str, Any]) -> list[FiniteStateKernelPair]:
    """The finite-state family: Q = (1 − λ)P + λA per system.

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


def study_tables(
    config: Mapping[str, Any], log: Callable[[str], None] | None = None
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Run the finite-state study for the configured family.

    For each system: exact values by :func:`exact_risk`, ``n_reps`` naive and ``n_reps`` SWRB
    replicates (CRN document = system index). Returns ``(systems, windows)``: ``systems`` has the
    columns of `docs/architecture.md`, "File contracts"; ``windows`` has one row per (system, L
    in ``window_depths``) with the exact R_L, B_L, R_H and the SWRB estimates of both interval
    endpoints with Hoeffding bounds (:func:`identified_interval_estimate`, level ``alpha``,
    weight bound :func:`swrb_weight_bound`).
    """
    seed, section = _family_section(config)
    H = int(section["horizon"])
    n_reps = int(section["n_reps"])
    alpha = float(section["alpha"])
    system_rows, window_rows = [], []
    for params, pair in zip(family_parameters(config), family(config), strict=True):
        system = params["system"]
        exact = exact_risk(pair, H)
        naive = naive_replicates(pair, H, n_reps, seed, document=system)
        swrb = swrb_replicates(pair, H, n_reps, seed, document=system)
        bound = swrb_weight_bound(pair, H)
        z_naive, z_swrb = naive.Z_R(), swrb.Z_R()
        naive_var, swrb_var = float(z_naive.var(ddof=1)), float(z_swrb.var(ddof=1))
        naive_cost, swrb_cost = float(naive.cost.mean()), float(swrb.cost.mean())
        system_rows.append(
            {
                "system": system,
                "lambda_scale": params["lambda"],
                "H": H,
                "n_states": pair.n_states,
                "n_reps": n_reps,
                "exact_R": exact.R_smc,
                "exact_O": exact.O_H,
                "exact_Pi": exact.Pi_H,
                "naive_mean": float(z_naive.mean()),
                "naive_var": naive_var,
                "swrb_mean": float(z_swrb.mean()),
                "swrb_var": swrb_var,
                "var_ratio": naive_var / swrb_var if swrb_var > 0 else float("nan"),
                "naive_cost": naive_cost,
                "swrb_cost": swrb_cost,
                "advantage": (naive_var * naive_cost) / (swrb_var * swrb_cost)
                if swrb_var > 0
                else float("nan"),
            }
        )
        for L in section["window_depths"]:
            est = identified_interval_estimate(swrb, int(L), alpha, bound)
            window_rows.append(
                {
                    "system": system,
                    "L": int(L),
                    "exact_R_L": exact.R_L(int(L)),
                    "exact_B_L": exact.B_L(int(L)),
                    "exact_R_H": exact.R_smc,
                    "swrb_R_L": est["R_L"],
                    "swrb_R_L_lo": est["R_L_lo"],
                    "swrb_R_L_hi": est["R_L_hi"],
                    "swrb_upper": est["upper"],
                    "swrb_upper_lo": est["upper_lo"],
                    "swrb_upper_hi": est["upper_hi"],
                    "alpha": alpha,
                    "weight_bound": bound,
                }
            )
        if log is not None:
            row = system_rows[-1]
            log(
                f"system {system}: lambda={row['lambda_scale']:.4f} P(tau<=H)="
                f"{exact.divergence_probability:.4f} R={exact.R_smc:.5f} "
                f"var_ratio={row['var_ratio']:.1f} cost {naive_cost:.1f} -> {swrb_cost:.1f}"
            )
    return pl.DataFrame(system_rows), pl.DataFrame(window_rows)


def study_summary(systems: pl.DataFrame) -> dict[str, float]:
    """Family summary of the finite-state study.

    ``var_ratio_min``/``_median``/``_max`` over systems; ``cost_factor`` = mean SWRB
    kernel-pair evaluations / mean naive evaluations (means over systems); ``advantage`` = the
    ratio of means mean(naive_var·naive_cost) / mean(swrb_var·swrb_cost);
    ``share_swrb_lower_variance`` = fraction of systems with swrb_var < naive_var.
    """
    if systems.height == 0:
        raise ValueError("systems: expected at least one system row")
    ratio = systems["var_ratio"].to_numpy()
    naive_work = (systems["naive_var"] * systems["naive_cost"]).mean()
    swrb_work = (systems["swrb_var"] * systems["swrb_cost"]).mean()
    return {
        "n_systems": float(systems.height),
        "var_ratio_min": float(np.min(ratio)),
        "var_ratio_median": float(np.median(ratio)),
        "var_ratio_max": float(np.max(ratio)),
        "cost_factor": float(systems["swrb_cost"].mean() / systems["naive_cost"].mean()),
        "advantage": float(naive_work / swrb_work),
        "share_swrb_lower_variance": float((systems["swrb_var"] < systems["naive_var"]).mean()),
    }
