"""Evaluation sample sizes from development data (SPEC §5, last bullet; paper §5.1).

For one action, a document's replicate-averaged token-mismatch fraction has variance
σ_b² + σ_w²/K: between-document variance σ_b² of the true document means (pooled within strata,
since the bootstrap resamples within strata) plus within-document path variance σ_w² over K
replicates. With n evaluation documents the pooled estimate has variance
V(n, K) = (σ_b² + σ_w²/K)/n. A document with K replicates costs c_doc + K·c_rep seconds (one
prefill and selection, then K decoded replicates).

Variances come from the development cohort's document statistics (method of moments:
σ_w² from D_H and D_H² within documents, σ_b² = within-stratum variance of document means minus
σ_w²/K_dev, clipped at 0). Costs come from the rollout ``benchmark:`` TSVs (Snakemake's ``s``
column). One rollout job runs every action of a study for one (model, stratum) (one model load,
one prefill per document), so its seconds are first attributed to the actions in proportion to
the rows each decodes, paths × rows per replicate (:func:`attribute_job_seconds`): 3 for an
evicting action (X, Y, Z; DESIGN §4) and 1 for the full-retention control (Q = P: only its X
rows run). Each (model, stratum) then gives one equation per action,
seconds = docs·c_doc + paths·c_rep, for the action and the control (whose documents run with
K_control replicates; its paths counted in the action's rows, paths·1/3); the non-negative
least-squares solution gives c_doc and c_rep. The proportional attribution charges the shared
per-document work (model load, prefill, selection) per decoded row, so c_doc comes out near 0
unless the cost per row differs between strata: c_rep is then the job's cost per replicate.

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
from scipy.optimize import nnls
from scipy.stats import norm

from kvdiverge.analysis.document_stats import AnalysisInputError

__all__ = [
    "attribute_job_seconds",
    "cost_per_unit",
    "optimal_design",
    "read_benchmark_seconds",
    "study_plan",
    "variance_components",
]


def read_benchmark_seconds(path: str | os.PathLike) -> float:
    """Wall-clock seconds of a Snakemake ``benchmark:`` TSV (mean of its repeats, column ``s``)."""
    try:
        frame = pl.read_csv(path, separator="\t")
    except (OSError, pl.exceptions.PolarsError) as exc:
        raise AnalysisInputError(f"{path}: not a readable benchmark TSV ({exc})") from exc
    if "s" not in frame.columns or frame.height == 0:
        raise AnalysisInputError(f"{path}: benchmark TSV lacks the seconds column 's'")
    return float(frame["s"].cast(pl.Float64).mean())


def attribute_job_seconds(
    seconds: float, paths: Mapping[str, float], rows: Mapping[str, float]
) -> dict[str, float]:
    """Split a multi-action rollout job's seconds among its actions (module docstring).

    Action a gets ``seconds · paths[a]·rows[a] / Σ_b paths[b]·rows[b]``: its share of the
    decoded rows (replicate paths × rows per replicate). The shares sum to ``seconds``.
    """
    weights = {a: float(paths[a]) * float(rows[a]) for a in paths}
    total = sum(weights.values())
    if total <= 0:
        raise AnalysisInputError(f"planning: a rollout job with no decoded rows ({weights})")
    return {a: seconds * w / total for a, w in weights.items()}


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


def cost_per_unit(jobs: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Non-negative least-squares (c_doc, c_rep) from jobs ``{seconds, docs, paths}``."""
    if not jobs:
        raise AnalysisInputError("planning: no rollout benchmark to measure cost from")
    a = np.array([[j["docs"], j["paths"]] for j in jobs], dtype=np.float64)
    b = np.array([j["seconds"] for j in jobs], dtype=np.float64)
    (c_doc, c_rep), _ = nnls(a, b)
    if c_rep <= 0:  # degenerate equations: charge everything per replicate
        c_doc, c_rep = 0.0, float(b.sum() / a[:, 1].sum())
    return {"c_doc": float(c_doc), "c_rep": float(c_rep)}


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
    benchmarks: Mapping[tuple[str, str], str | os.PathLike],
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

    ``stats[model]``: that model's document statistics (every cohort: job sizes count all the
    documents a rollout job ran); ``benchmarks[(model, stratum)]``: the benchmark TSV of the
    rollout job that ran all of the study's ``actions`` (the control's included) for that model
    and stratum. Per model and non-control action: σ_b², σ_w², c_doc, c_rep, the least-cost K
    and document count for ``half_width`` on R_SMC, and, when the configured K and document
    count are given, their half-width and cost for comparison.
    """
    rows = {a: 1 if a == control else 3 for a in actions}
    plans = []
    for model, frame in stats.items():
        jobs = frame.group_by("action", "stratum").agg(docs=pl.len(), paths=pl.col("n_paths").sum())
        sizes = {(r["action"], r["stratum"]): r for r in jobs.iter_rows(named=True)}
        strata = sorted(frame["stratum"].unique())
        dev = frame.filter(pl.col("cohort") == dev_cohort)
        if dev.height == 0:
            raise AnalysisInputError(f"planning: model {model!r} has no {dev_cohort!r} documents")
        attributed = {}
        for stratum in strata:
            if (model, stratum) not in benchmarks:
                raise AnalysisInputError(f"planning: no rollout benchmark for {(model, stratum)}")
            missing = [a for a in actions if (a, stratum) not in sizes]
            if missing:
                raise AnalysisInputError(
                    f"planning: no document statistics for {missing[0]!r} in {stratum!r}"
                )
            seconds = read_benchmark_seconds(benchmarks[(model, stratum)])
            paths = {a: sizes[(a, stratum)]["paths"] for a in actions}
            for a, share in attribute_job_seconds(seconds, paths, rows).items():
                attributed[(a, stratum)] = share
        for action in actions:
            if action == control:
                continue
            equations = [  # the control's paths in the action's row units
                {
                    "seconds": attributed[(act, stratum)],
                    "docs": sizes[(act, stratum)]["docs"],
                    "paths": sizes[(act, stratum)]["paths"] * rows[act] / rows[action],
                }
                for act in (action, control)
                for stratum in strata
            ]
            cost = cost_per_unit(equations)
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
