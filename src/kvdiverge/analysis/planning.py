"""Evaluation sample sizes from development data (`docs/method.md`, "Sample-size planning").

For one action, a document's replicate-averaged token-mismatch fraction has variance
σ_b² + σ_w²/K: between-document variance σ_b² of the true document means (pooled within strata,
since the bootstrap resamples within strata) plus within-document path variance σ_w² over K
replicates. With n evaluation documents the pooled estimate has variance
V(n, K) = (σ_b² + σ_w²/K)/n. A document with K replicates costs c_doc + K·c_rep seconds (one
prefill and selection, then K decoded replicates).

Variances come from the development cohort's document statistics (method of moments:
σ_w² from D_H and D_H² within documents, σ_b² = within-stratum variance of document means minus
σ_w²/K_dev, clipped at 0). Costs come from the seconds the rollout engine measures where the work
happens and records in each trajectory file's metadata key ``timing``
(:func:`kvdiverge.engine.run_stratum_rollout_job`): per action and (model, stratum) job, its
documents and paths (replicates summed over documents) and the seconds of the documents'
prefills, of its selection and gather, and of its decoding. Over the action's files (every
stratum, development and evaluation cohorts alike, as they ran in the same jobs)
c_doc = Σ(prefill + selection seconds) / Σ documents and c_rep = Σ decode seconds / Σ paths
(:func:`cost_from_timing`). Attribution: a rollout job runs every action of a study with ONE
prefill per document; that prefill is charged in full to each action (an evaluation run of the
action alone would pay it), and the decode seconds of actions sharing a reference stream X are
split as the row-steps a solo run would decode (the engine's ``decode_seconds``: X rows, Y rows
and Z rows after each split, X counted once in the shared batch), so c_rep is the cost of one
replicate of the action alone.
Model loading (once per job, not per document or replicate) is left out: it does not change
the least-cost design.

The plan minimizes n·(c_doc + K·c_rep) subject to z·sqrt(V(n, K)) ≤ half_width, with n a
multiple of the number of strata (equal documents per stratum), by exhaustive search over
K = 1..max_K (n is then the least feasible); the continuous optimum
K* = sqrt(c_doc σ_w² / (c_rep σ_b²)) is reported beside it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import numpy as np
import polars as pl
from scipy.stats import norm

from kvdiverge.analysis.document_stats import AnalysisInputError
from kvdiverge.trajectories import TrajectoryFormatError, read_trajectory_metadata

__all__ = [
    "cost_from_timing",
    "optimal_design",
    "read_timing",
    "study_plan",
    "variance_components",
]

TIMING_FIELDS = ("documents", "paths", "prefill_seconds", "selection_seconds", "decode_seconds")


def read_timing(path: str | os.PathLike) -> dict[str, float]:
    """The measured ``timing`` of a trajectory file's metadata (module docstring)."""
    try:
        meta = read_trajectory_metadata(path)
    except (OSError, TrajectoryFormatError) as exc:
        raise AnalysisInputError(str(exc)) from exc  # names the file
    timing = meta.get("timing")
    if not isinstance(timing, dict):
        raise AnalysisInputError(
            f"{path}: trajectory metadata lacks 'timing' (rerun its rollout job to measure cost)"
        )
    missing = [k for k in TIMING_FIELDS if not isinstance(timing.get(k), int | float)]
    if missing:
        raise AnalysisInputError(f"{path}: timing lacks numeric field(s) {', '.join(missing)}")
    return {k: float(timing[k]) for k in TIMING_FIELDS}


def cost_from_timing(timings: Sequence[Mapping[str, float]], where: str = "planning") -> dict:
    """c_doc and c_rep (seconds) of one action from its files' ``timing`` (module docstring).

    c_doc = Σ(prefill_seconds + selection_seconds) / Σ documents;
    c_rep = Σ decode_seconds / Σ paths.
    """
    docs = sum(t["documents"] for t in timings)
    paths = sum(t["paths"] for t in timings)
    if docs <= 0 or paths <= 0:
        raise AnalysisInputError(f"{where}: timing counts no documents or no paths")
    per_doc = sum(t["prefill_seconds"] + t["selection_seconds"] for t in timings)
    return {
        "c_doc": float(per_doc / docs),
        "c_rep": float(sum(t["decode_seconds"] for t in timings) / paths),
    }


def variance_components(stats: pl.DataFrame, action: str, where: str = "document stats") -> dict:
    """σ_b², σ_w² and the development K of D_H for one action (module docstring).

    ``stats``: document statistics of the development cohort (columns ``mismatch``,
    ``mismatch_sq``, ``n_paths``, ``stratum``).
    """
    rows = stats.filter(pl.col("action") == action)
    if rows.height < 2:
        raise AnalysisInputError(
            f"{where}: action {action!r} needs at least 2 development documents, has {rows.height}"
        )
    k = rows["n_paths"].to_numpy().astype(np.float64)
    mean = rows["mismatch"].to_numpy()
    spread = rows["mismatch_sq"].to_numpy() - mean**2  # within-document, divisor K
    within = np.where(k > 1, spread * k / np.maximum(k - 1, 1), 0.0)
    sigma_w2 = float(np.clip(within, 0, None).mean())
    centred = rows.with_columns(
        dev=pl.col("mismatch") - pl.col("mismatch").mean().over("stratum"),
        n_s=pl.len().over("stratum"),
    )
    n_strata = centred["stratum"].n_unique()
    dof = rows.height - n_strata
    if dof < 1:
        raise AnalysisInputError(
            f"{where}: action {action!r} needs two development documents in some stratum"
        )
    var_means = float((centred["dev"] ** 2).sum() / dof)
    k_dev = float(np.mean(k))
    sigma_b2 = max(var_means - sigma_w2 / k_dev, 0.0)
    return {"sigma_between2": sigma_b2, "sigma_within2": sigma_w2, "K_dev": k_dev}


def optimal_design(
    sigma_between2: float,
    sigma_within2: float,
    c_doc: float,
    c_rep: float,
    half_width: float,
    level: float = 0.95,
    n_strata: int = 1,
    max_K: int = 1024,
    min_docs_per_stratum: int = 2,
) -> dict[str, float]:
    """Least-cost (documents, K) reaching ``half_width`` at ``level`` (module docstring).

    At least ``min_docs_per_stratum`` documents per stratum (2: a stratified bootstrap needs
    variation within every stratum) and at most ``max_K`` replicates, so that a development
    estimate σ_b² = 0 from a handful of documents cannot put everything into one document.
    """
    if half_width <= 0:
        raise AnalysisInputError(f"planning: half_width must be positive, got {half_width}")
    z = float(norm.ppf(0.5 + level / 2))
    if sigma_between2 > 0 and c_rep > 0:
        k_star = math.sqrt(max(c_doc, 0.0) * sigma_within2 / (c_rep * sigma_between2))
    else:
        k_star = float(max_K) if sigma_within2 > 0 else 1.0
    ks = np.arange(1, max_K + 1)
    per_doc = sigma_between2 + sigma_within2 / ks
    n = np.maximum(1, np.ceil((z / half_width) ** 2 * per_doc - 1e-9)).astype(np.int64)
    n = np.maximum(n_strata * -(-n // n_strata), n_strata * min_docs_per_stratum)
    cost = n * (c_doc + ks * c_rep)
    i = int(np.argmin(cost))  # first minimum: the smallest K among equal costs
    return {
        "K": int(ks[i]),
        "n_docs": int(n[i]),
        "docs_per_stratum": int(n[i] // n_strata),
        "cost_seconds": float(cost[i]),
        "half_width": z * math.sqrt(per_doc[i] / n[i]),
        "K_continuous": k_star,
    }


def study_plan(
    stats: Mapping[str, pl.DataFrame],
    trajectories: Mapping[tuple[str, str, str], str | os.PathLike],
    *,
    actions: Sequence[str],
    control: str,
    dev_cohort: str = "dev",
    half_width: float = 0.01,
    level: float = 0.95,
    max_K: int = 1024,
    min_docs_per_stratum: int = 2,
    configured_K: int | None = None,
    configured_docs: int | None = None,
) -> dict:
    """The sample-size plan of a study (module docstring), as a JSON-ready dict.

    ``stats[model]``: that model's document statistics (the development cohort gives the
    variances); ``trajectories[(model, action, stratum)]``: the trajectory file whose
    ``timing`` metadata gives the costs. Per model and non-control action: σ_b², σ_w², c_doc,
    c_rep, the least-cost K and document count for ``half_width`` on R_SMC, and, when the
    configured K and document count are given, their half-width and cost for comparison.
    """
    plans = []
    for model, frame in stats.items():
        strata = sorted(frame["stratum"].unique())
        dev = frame.filter(pl.col("cohort") == dev_cohort)
        if dev.height == 0:
            raise AnalysisInputError(f"planning: model {model!r} has no {dev_cohort!r} documents")
        for action in actions:
            if action == control:
                continue
            missing = [s for s in strata if (model, action, s) not in trajectories]
            if missing:
                raise AnalysisInputError(
                    f"planning: no trajectory file for {(model, action, missing[0])}"
                )
            timings = [read_timing(trajectories[(model, action, s)]) for s in strata]
            cost = cost_from_timing(timings, where=f"planning {model!r}/{action!r}")
            var = variance_components(dev, action, where=f"model {model!r} development cohort")
            design = optimal_design(
                var["sigma_between2"],
                var["sigma_within2"],
                cost["c_doc"],
                cost["c_rep"],
                half_width,
                level,
                n_strata=len(strata),
                max_K=max_K,
                min_docs_per_stratum=min_docs_per_stratum,
            )
            entry = {"model": model, "action": action, **var, **cost, **design}
            if configured_K and configured_docs:
                z = float(norm.ppf(0.5 + level / 2))
                per_doc = var["sigma_between2"] + var["sigma_within2"] / configured_K
                entry["configured"] = {
                    "K": configured_K,
                    "n_docs": configured_docs,
                    "half_width": z * math.sqrt(per_doc / configured_docs),
                    "cost_seconds": configured_docs
                    * (cost["c_doc"] + configured_K * cost["c_rep"]),
                }
            plans.append(entry)
    return {
        "estimand": "R_smc",
        "target_half_width": half_width,
        "level": level,
        "strata": sorted({s for f in stats.values() for s in f["stratum"].unique()}),
        "plans": plans,
    }
