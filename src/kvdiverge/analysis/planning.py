"""Evaluation sample sizes from the development rollouts (`docs/method.md`, "Sample-size
planning"; `docs/prespecification.md`).

What is planned. A study without prespecified endpoints plans each non-control action's R_SMC
at the pointwise ``level`` of ``analysis.planning``. A study with a prespecified family
(``family_endpoints`` > 1, study 2) plans its endpoints instead: every (model, action,
estimand) of the family, at the family level 1 − α/m that the lock gives its intervals
(99.375% for α = 0.05, m = 8), each to the same target ``half_width``. The study's K is the
largest K its entries need, and the plan names the entry that sets it (``binding``).

Variance model. For one entry, a document's replicate-averaged value has variance
σ_b² + σ_w²/K: between-document variance σ_b² of the true document means (pooled within strata,
since the bootstrap resamples within strata) plus within-document path variance σ_w² over K
replicates, so that with n documents the estimate has variance V(n, K) = (σ_b² + σ_w²/K)/n.
Per path (one development replicate) the value is the estimand's own path statistic (R_SMC:
D_H; S_99: the fraction of steps with δ_t above the clock's saturation threshold), or, for a
ratio estimand of document averages (B(a) = (late − early)/cohort, the branch windows), its
linearisation u = (num − θ·den)/mean(den) at the development estimate θ (the delta method:
the estimate minus θ is to first order the document average of u). Method of moments
(:func:`variance_components`): σ_w² from the values and their squares within documents,
σ_b² = within-stratum variance of document means minus σ_w²/K_dev, clipped at 0. The
development cohort must have at least 2 paths per document (K_dev ≥ 2): with one path σ_w²
cannot be estimated and the plan refuses the file — except under greedy decoding
(``rollout.temperature`` 0, recorded in the file), where every path of a document is the same
and σ_w² = 0 exactly: one path per document, and the plan's K is 1.

Cost model (deterministic: the same config and development trajectories plan the same K on
any machine and under any load). One unit is one token through the model, prefilled or decoded
(2·parameters FLOPs either way; attention's share, growing with the context, is left out). A
document costs c_doc = its prompt tokens (one prefill, charged in full to each action: an
evaluation run of the action alone pays it) and a replicate c_rep = the row-steps a solo run of
the action decodes: X's and Y's H steps and the fixed-history row Z from the split on,
2H + (H − τ)+, averaged over the development paths (:func:`deterministic_cost`). The seconds
the engine measured (``timing`` metadata, :func:`cost_from_timing`) are copied into the plan's
``measured`` field for information only; the lock leaves them out of its hash.

Two designs per entry:

* the least-cost design (:func:`optimal_design`): n·(c_doc + K·c_rep) minimised subject to
  z·sqrt(V(n, K)) ≤ half_width, with n a multiple of the number of strata (equal documents per
  stratum), by exhaustive search over K = 1..max_K; the continuous optimum
  K* = sqrt(c_doc σ_w² / (c_rep σ_b²)) is reported beside it;
* the evaluation design (:func:`evaluation_replicates`): the number of evaluation documents is
  fixed by the config (the workflow's jobs are known before it runs), so K is the smallest
  K ≤ max_K that reaches the half-width with those documents, or, when none does, the
  least-cost design's K (beyond it, replicates buy less precision per unit of cost than
  documents would) — and the plan then says in one line how many documents per stratum the
  target needs.

Each entry's ``evaluation`` also carries the development stage's uncertainty about its
predicted half-width (:func:`kvdiverge.analysis.plan_precision.half_width_spread`: σ_b²'s moment
estimate before clipping, and bootstrap intervals of σ_b², σ_w² and the half-width).

This module imports no other analysis module but :mod:`kvdiverge.analysis.plan_precision` and
the estimand and statistic registries on purpose: a change to its code re-plans, and a new plan
re-locks the study and reruns its evaluation rollouts (`docs/prespecification.md`), so nothing
but planning code and the estimands' definitions may change the plan (a mean endpoint's path
statistic is the registry's; the branch windows are written here again, and a test holds them
equal to :mod:`kvdiverge.analysis.document_stats`'s).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import polars as pl
from scipy.stats import norm

from kvdiverge.analysis.estimand_registry import mean_endpoints
from kvdiverge.analysis.plan_precision import half_width_spread
from kvdiverge.analysis.statistic_registry import STATISTICS, PathArrays, horizon_steps
from kvdiverge.io.trajectories import (
    TrajectoryFormatError,
    read_trajectories,
    read_trajectory_metadata,
)

__all__ = [
    "COST_UNITS",
    "PLANNED_ENDPOINTS",
    "PlanningError",
    "cost_from_timing",
    "deterministic_cost",
    "development_moments",
    "development_paths",
    "endpoint_path_values",
    "evaluation_replicates",
    "optimal_design",
    "read_timing",
    "study_plan",
    "variance_components",
]

TIMING_FIELDS = ("documents", "paths", "prefill_seconds", "selection_seconds", "decode_seconds")

COST_UNITS = "tokens"
"""The unit of c_doc, c_rep and ``cost``: one token through the model, prefilled or decoded."""

_MEAN_ENDPOINTS = mean_endpoints()
"""{estimand: its path statistic} of every estimand that is a document average of one
statistic (:func:`kvdiverge.analysis.estimand_registry.mean_endpoints`)."""
_RATIO_ENDPOINTS = {  # numerator terms (column, sign) over the branch cohort
    "branch_contrast_B": (("branch_late", 1.0), ("branch_early", -1.0)),
    "branch_early": (("branch_early", 1.0),),
    "branch_late": (("branch_late", 1.0),),
}
PLANNED_ENDPOINTS = (*_MEAN_ENDPOINTS, *_RATIO_ENDPOINTS)
"""The estimands the plan has a path statistic for; another endpoint is planned on R_SMC, with
a note saying so."""


class PlanningError(ValueError):
    """A development trajectory file or a planning setting is unusable; one line."""


def read_timing(path: str | os.PathLike) -> dict[str, float]:
    """The measured ``timing`` of a trajectory file's metadata (for information only)."""
    try:
        meta = read_trajectory_metadata(path)
    except (OSError, TrajectoryFormatError) as exc:
        raise PlanningError(str(exc)) from exc  # names the file
    timing = meta.get("timing")
    if not isinstance(timing, dict):
        raise PlanningError(
            f"{path}: trajectory metadata lacks 'timing' (rerun its rollout job to measure cost)"
        )
    missing = [k for k in TIMING_FIELDS if not isinstance(timing.get(k), int | float)]
    if missing:
        raise PlanningError(f"{path}: timing lacks numeric field(s) {', '.join(missing)}")
    return {k: float(timing[k]) for k in TIMING_FIELDS}


def cost_from_timing(timings: Sequence[Mapping[str, float]], where: str = "planning") -> dict:
    """Measured seconds per document and per replicate of one action, from its files'
    ``timing``: c_doc = Σ(prefill + selection seconds) / Σ documents, c_rep = Σ decode seconds
    / Σ paths. For information: the plan's costs are :func:`deterministic_cost`'s."""
    docs = sum(t["documents"] for t in timings)
    paths = sum(t["paths"] for t in timings)
    if docs <= 0 or paths <= 0:
        raise PlanningError(f"{where}: timing counts no documents or no paths")
    per_doc = sum(t["prefill_seconds"] + t["selection_seconds"] for t in timings)
    return {
        "c_doc": float(per_doc / docs),
        "c_rep": float(sum(t["decode_seconds"] for t in timings) / paths),
    }


def _clock_steps(H: int, clock: Mapping[str, Any] | None) -> tuple[int, int, float]:
    """(branch depth d, window w, saturation threshold) as ``Clock.for_horizon`` rounds them."""
    clock = dict(clock or {})
    depth = max(1, int(round(float(clock.get("branch_depth", 0.5)) * H)))
    window = max(1, int(round(float(clock.get("window", 0.125)) * H)))
    return depth, window, float(clock.get("saturation", 0.99))


def development_paths(
    path: str | os.PathLike, stratum: str, clock: Mapping[str, Any] | None = None
) -> pl.DataFrame:
    """One row per path (document, replicate) of a development trajectory file: ``doc_id``,
    ``stratum``, ``n_prompt``, ``row_steps`` (2H + (H − τ)+) and the path statistics the plan
    uses: the statistic of every mean endpoint (:func:`_endpoint_statistics`: ``mismatch``
    (D_H), ``saturation``, ``diverged``, ``rollout_tv``, ``fixed_tv``, ``exposure``, ...),
    ``branch_cohort`` (1{τ ≤ d}), ``branch_early`` and ``branch_late`` (the cohort's mean δ
    over lags 1..w and d − w + 1..d; ``clock``: ``analysis.clock``'s fractions of H).

    The file is checked against its contract first (whole paths, replicate counts), and every
    document must have at least 2 paths (K_dev ≥ 2), else one line naming the file; a file
    rolled out greedily (metadata ``temperature`` 0: every replicate the same path, σ_w² = 0
    exactly) may hold one path per document.
    """
    try:
        frame = read_trajectories(path)
    except TrajectoryFormatError as exc:
        raise PlanningError(str(exc)) from exc
    if frame.height == 0:
        raise PlanningError(f"{path}: development trajectory file has no rows")
    frame = frame.sort("doc_id", "replicate", "t")
    H = int(frame["t"].max())
    n = frame.height // H
    single = frame.group_by("doc_id").agg(k=pl.col("replicate").n_unique()).filter(pl.col("k") < 2)
    greedy = read_trajectory_metadata(path).get("temperature") == 0  # one path, no variance
    if single.height and not greedy:
        raise PlanningError(
            f"{path}: {single.height} development document(s) have one path each (e.g. "
            f"{sorted(single['doc_id'])[0]!r}); the plan needs K_dev >= 2 paths per document "
            f"to estimate the within-document variance"
        )
    mism = frame["mismatch"].to_numpy().reshape(n, H)
    delta = frame["tv_rollout"].to_numpy().astype(np.float64).reshape(n, H)
    fixed = frame["tv_fixed"].to_numpy().astype(np.float64).reshape(n, H)
    tau = np.where(mism.any(1), mism.argmax(1) + 1, H + 1)
    d, w, _ = _clock_steps(H, clock)
    cohort = tau <= d
    lags = np.minimum(tau[:, None] + np.arange(1, d + 1)[None, :], H)
    branch = np.take_along_axis(delta, lags - 1, axis=1) * cohort[:, None]
    first = frame.gather(np.arange(n) * H)
    return pl.DataFrame(
        {
            "doc_id": first["doc_id"],
            "stratum": stratum,
            "n_prompt": first["n_prompt"].cast(pl.Float64),
            "row_steps": (2 * H + np.clip(H - tau, 0, None)).astype(np.float64),
            **_endpoint_statistics(path, frame, (mism, delta, fixed), n, clock),
            "branch_cohort": cohort.astype(np.float64),
            "branch_early": branch[:, :w].sum(1) / w,
            "branch_late": branch[:, d - w :].sum(1) / w,
        }
    )


def _endpoint_statistics(
    path: str | os.PathLike,
    frame: pl.DataFrame,
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray],
    n: int,
    clock: Mapping[str, Any] | None,
) -> dict[str, np.ndarray]:
    """Per path, the statistic of every mean endpoint (:func:`mean_endpoints`), each computed
    by its entry of :data:`kvdiverge.analysis.statistic_registry.STATISTICS`: I_t, δ_t, f_t
    (``arrays``, (n, H)) and the file's EOS flags under the clock of ``clock``'s fractions."""
    H = arrays[0].shape[1]
    try:  # the clock's step counts, unchecked as _clock_steps's (a short H plans too)
        steps = SimpleNamespace(**horizon_steps(H, **dict(clock or {})))
    except TypeError as exc:
        raise PlanningError(f"{path}: analysis.clock: {exc}") from exc
    eos = [frame[c].to_numpy().reshape(n, H) for c in ("x_eos", "y_eos")]
    batch = PathArrays(*arrays, *eos, steps)
    names = dict.fromkeys(mean_endpoints().values())
    return {s: np.asarray(STATISTICS[s].compute(batch), dtype=np.float64) for s in names}


def _document_average(paths: pl.DataFrame, column: str | pl.Expr) -> float:
    """The estimand's document average: replicate means first, every document weighing one."""
    expr = pl.col(column) if isinstance(column, str) else column
    means = paths.group_by("doc_id").agg(v=expr.mean())
    return float(means["v"].mean())


def endpoint_path_values(paths: pl.DataFrame, estimand: str) -> pl.Series | None:
    """Per path of :func:`development_paths`, the value whose document average estimates
    ``estimand`` to first order (module docstring): the path statistic of a mean estimand, the
    linearisation (num − θ·den)/mean(den) of a ratio. ``None`` when the plan has no statistic
    for ``estimand`` or the development ratio is undefined (an empty branch cohort)."""
    means = mean_endpoints()  # the registry's, estimands registered later included
    if estimand in means:
        return paths[means[estimand]].rename("value")
    if estimand not in _RATIO_ENDPOINTS:
        return None
    num = sum(sign * pl.col(col) for col, sign in _RATIO_ENDPOINTS[estimand])
    den = _document_average(paths, "branch_cohort")
    if den <= 0:
        return None
    theta = _document_average(paths, num) / den
    u = paths.select(v=(num - theta * pl.col("branch_cohort")) / den)["v"]
    return u.rename("value")


def _moments(paths: pl.DataFrame, values: pl.Series) -> pl.DataFrame:
    """Per document: ``n_paths``, the mean of ``values`` and of their squares, ``stratum``."""
    return (
        paths.select("doc_id", "stratum")
        .with_columns(value=values)
        .group_by("doc_id", "stratum")
        .agg(n_paths=pl.len(), value=pl.col("value").mean(), value_sq=(pl.col("value") ** 2).mean())
        .sort("doc_id")
    )


def development_moments(path: str | os.PathLike, stratum: str) -> pl.DataFrame:
    """Per document of a development trajectory file: ``n_paths`` and the replicate means of
    D_H (``mismatch``) and D_H² (``mismatch_sq``), with its ``stratum``."""
    paths = development_paths(path, stratum)
    return (
        _moments(paths, paths["mismatch"])
        .rename({"value": "mismatch", "value_sq": "mismatch_sq"})
        .select("doc_id", "n_paths", "mismatch", "mismatch_sq", "stratum")
    )


def deterministic_cost(paths: pl.DataFrame) -> dict[str, float]:
    """c_doc (prompt tokens per document) and c_rep (row-steps per replicate) of one action
    from its development paths (:func:`development_paths`; module docstring)."""
    per_doc = paths.group_by("doc_id").agg(pl.col("n_prompt").first())
    return {
        "c_doc": float(per_doc["n_prompt"].mean()),
        "c_rep": float(paths["row_steps"].mean()),
    }


def variance_components(
    stats: pl.DataFrame, where: str = "development cohort", column: str = "mismatch"
) -> dict:
    """σ_b², σ_w² and the development K of one entry (module docstring).

    ``stats``: one row per development document (columns ``column``, ``column``_sq, ``n_paths``,
    ``stratum``; :func:`development_moments`).
    """
    if stats.height < 2:
        raise PlanningError(f"{where}: needs at least 2 development documents, has {stats.height}")
    k = stats["n_paths"].to_numpy().astype(np.float64)
    mean = stats[column].to_numpy()
    spread = stats[f"{column}_sq"].to_numpy() - mean**2  # within-document, divisor K
    within = np.where(k > 1, spread * k / np.maximum(k - 1, 1), 0.0)
    sigma_w2 = float(np.clip(within, 0, None).mean())
    centred = stats.with_columns(dev=pl.col(column) - pl.col(column).mean().over("stratum"))
    dof = stats.height - centred["stratum"].n_unique()
    if dof < 1:
        raise PlanningError(f"{where}: needs two development documents in some stratum")
    var_means = float((centred["dev"] ** 2).sum() / dof)
    k_dev = float(np.mean(k))
    sigma_b2 = max(var_means - sigma_w2 / k_dev, 0.0)
    return {"sigma_between2": sigma_b2, "sigma_within2": sigma_w2, "K_dev": k_dev}


def _z(level: float) -> float:
    return float(norm.ppf(0.5 + level / 2))


def _documents_needed(per_doc: np.ndarray | float, half_width: float, z: float) -> np.ndarray:
    """The fewest documents n with z·sqrt(per_doc / n) ≤ half_width (at least 1)."""
    return np.maximum(1, np.ceil((z / half_width) ** 2 * np.asarray(per_doc) - 1e-9)).astype(
        np.int64
    )


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
        raise PlanningError(f"planning: half_width must be positive, got {half_width}")
    z = _z(level)
    if sigma_between2 > 0 and c_rep > 0:
        k_star = math.sqrt(max(c_doc, 0.0) * sigma_within2 / (c_rep * sigma_between2))
    else:
        k_star = float(max_K) if sigma_within2 > 0 else 1.0
    ks = np.arange(1, max_K + 1)
    per_doc = sigma_between2 + sigma_within2 / ks
    n = _documents_needed(per_doc, half_width, z)
    n = np.maximum(n_strata * -(-n // n_strata), n_strata * min_docs_per_stratum)
    cost = n * (c_doc + ks * c_rep)
    i = int(np.argmin(cost))  # first minimum: the smallest K among equal costs
    return {
        "K": int(ks[i]),
        "n_docs": int(n[i]),
        "docs_per_stratum": int(n[i] // n_strata),
        "cost": float(cost[i]),
        "half_width": z * math.sqrt(per_doc[i] / n[i]),
        "K_continuous": k_star,
    }


def evaluation_replicates(
    sigma_between2: float,
    sigma_within2: float,
    n_docs: int,
    half_width: float,
    level: float = 0.95,
    max_K: int = 1024,
) -> int | None:
    """The smallest K ≤ ``max_K`` whose half-width with ``n_docs`` documents reaches
    ``half_width``, or ``None`` when no K does (σ_b²/n alone is too large, or K would exceed
    ``max_K``)."""
    if n_docs < 1:
        raise PlanningError(f"planning: expected at least 1 evaluation document, got {n_docs}")
    ks = np.arange(1, max_K + 1)
    reached = _z(level) * np.sqrt((sigma_between2 + sigma_within2 / ks) / n_docs) <= half_width
    return int(ks[np.argmax(reached)]) if reached.any() else None


def _half_width_and_cost(var: Mapping, cost: Mapping, K: int, n_docs: int, z: float) -> dict:
    per_doc = var["sigma_between2"] + var["sigma_within2"] / K
    return {
        "K": K,
        "n_docs": n_docs,
        "half_width": z * math.sqrt(per_doc / n_docs),
        "cost": n_docs * (cost["c_doc"] + K * cost["c_rep"]),
    }


def _entries(
    models: Sequence[str],
    actions: Sequence[str],
    control: str,
    endpoints: Mapping[str, Any] | None,
) -> list[tuple[str, str, str]]:
    """(model, action, estimand) to plan: the family's endpoints, else R_SMC of each pair."""
    if endpoints:
        wanted = {(e["model"], e["action"], e["estimand"]) for e in endpoints["family"]}
        return [
            (m, a, e)
            for m in models
            for a in actions
            if a != control
            for e in endpoints["estimands"]
            if (m, a, e) in wanted
        ]
    return [(m, a, "R_smc") for m in models for a in actions if a != control]


def study_plan(
    development: Mapping[tuple[str, str, str], str | os.PathLike],
    *,
    actions: Sequence[str],
    control: str,
    documents_per_stratum: int,
    cohort: str,
    half_width: float = 0.01,
    level: float = 0.95,
    max_K: int = 1024,
    min_docs_per_stratum: int = 2,
    pinned_K: int | None = None,
    endpoints: Mapping[str, Any] | None = None,
) -> dict:
    """The sample-size plan of a study (module docstring), as a JSON-ready dict.

    ``development[(model, action, stratum)]``: the development trajectory file of that job;
    ``documents_per_stratum``: the evaluation documents the config fixes per stratum (of
    ``cohort``); ``pinned_K``: the config's K when it pins one (else the plan's K is used);
    ``endpoints``: the study's prespecified endpoints as the lock records them
    (:func:`kvdiverge.analysis.prespecification.prespecified`: ``family``, ``estimands``,
    ``level``, ``clock``), or ``None`` (plan R_SMC at ``level``).

    ``plans``: one entry per planned (model, action, estimand): σ_b², σ_w², K_dev, c_doc, c_rep
    (in :data:`COST_UNITS`), the least-cost design (``K``, ``n_docs``, ``docs_per_stratum``,
    ``cost``, ``half_width``, ``K_continuous``), ``K_needed`` (:func:`evaluation_replicates` at
    the configured documents; ``None`` when none ≤ max_K suffices) and ``evaluation``:
    half-width and cost at the study's K with the documents per stratum the target would need.
    Top level: ``estimands`` planned and ``level`` used, ``K`` (``pinned_K``, else
    ``K_planned``), ``K_planned`` (the largest of each entry's ``K_needed``, or its least-cost K
    where that is ``None``), ``K_source``, ``binding`` (the entry that sets ``K_planned`` —
    among several, the one asking for the most documents — and the documents per stratum it
    asks for), ``notes`` (one line each: more documents needed,
    ``max_K`` binding, an endpoint planned on R_SMC) and ``measured`` (the engine's seconds,
    for information).
    """
    if documents_per_stratum < 1:
        raise PlanningError(
            f"planning: expected at least 1 evaluation document per stratum, "
            f"got {documents_per_stratum}"
        )
    if endpoints:
        level = float(endpoints["level"])
    models = list(dict.fromkeys(m for m, _, _ in development))
    strata = sorted({s for _, _, s in development})
    n_eval = documents_per_stratum * len(strata)
    z = _z(level)
    clock = (endpoints or {}).get("clock")
    plans: list[dict] = []
    measured: list[dict] = []
    notes: list[str] = []
    bounded: list[tuple[str, int]] = []  # (model/action/estimand, least-cost K above max_K)
    cache: dict[tuple[str, str], tuple[pl.DataFrame, dict]] = {}
    moments: dict[int, pl.DataFrame] = {}  # per entry: its development documents' moments
    for model, action, estimand in _entries(models, actions, control, endpoints):
        where = f"planning {model}/{action}"
        if (model, action) not in cache:
            missing = [s for s in strata if (model, action, s) not in development]
            if missing:
                raise PlanningError(
                    f"planning: no development trajectory file for {(model, action, missing[0])}"
                )
            files = [development[(model, action, s)] for s in strata]
            paths = pl.concat(
                [development_paths(f, s, clock) for f, s in zip(files, strata, strict=True)]
            )
            cache[(model, action)] = (paths, deterministic_cost(paths))
            try:
                seconds = cost_from_timing([read_timing(f) for f in files], where=where)
            except PlanningError:
                seconds = None
            measured.append({"model": model, "action": action, "seconds": seconds})
        paths, cost = cache[(model, action)]
        values = endpoint_path_values(paths, estimand)
        if values is None:
            reason = (
                "the plan has no path statistic for it"
                if estimand not in PLANNED_ENDPOINTS
                else "no development path entered the branch cohort"
            )
            notes.append(f"endpoint {estimand} of {model}/{action} is planned on R_smc: {reason}")
            estimand, values = "R_smc", paths["mismatch"]
            if any(e["model"] == model and e["action"] == action and e["estimand"] == estimand
                   for e in plans):  # fmt: skip
                continue
        moments[len(plans)] = _moments(paths, values)
        var = variance_components(
            moments[len(plans)], where=f"{where}: development cohort", column="value"
        )
        design = optimal_design(
            var["sigma_between2"], var["sigma_within2"], cost["c_doc"], cost["c_rep"],
            half_width, level, n_strata=len(strata), max_K=max_K,
            min_docs_per_stratum=min_docs_per_stratum,
        )  # fmt: skip
        needed = evaluation_replicates(
            var["sigma_between2"], var["sigma_within2"], n_eval, half_width, level, max_K
        )
        if needed is None and design["K"] == max_K:  # is the least-cost K beyond the bound?
            wider = optimal_design(
                var["sigma_between2"], var["sigma_within2"], cost["c_doc"], cost["c_rep"],
                half_width, level, n_strata=len(strata), max_K=4 * max_K,
                min_docs_per_stratum=min_docs_per_stratum,
            )  # fmt: skip
            if wider["K"] > max_K:
                bounded.append((f"{model}/{action} {estimand}", wider["K"]))
        entry = {"model": model, "action": action, "estimand": estimand, **var, **cost}
        plans.append({**entry, **design, "K_needed": needed})
    if not plans:
        raise PlanningError("planning: no development trajectory files of a non-control action")
    wants = [e["K_needed"] if e["K_needed"] is not None else e["K"] for e in plans]
    planned = max(wants)
    K = pinned_K if pinned_K is not None else planned
    worst = None
    for i, e in enumerate(plans):
        e["evaluation"] = _half_width_and_cost(e, e, K, n_eval, z)
        names = (e["model"], e["action"], e["estimand"])
        e["evaluation"].update(half_width_spread(moments[i], K, n_eval, level, names))
        per_doc = e["sigma_between2"] + e["sigma_within2"] / K
        need = int(-(-int(_documents_needed(per_doc, half_width, z)) // len(strata)))
        e["evaluation"]["docs_per_stratum_needed"] = need
        if need > documents_per_stratum and (worst is None or need > worst[0]):
            worst = (need, f"{e['model']}/{e['action']}", e["estimand"])
    # the entry that sets K; among entries at that K, the one asking for the most documents
    first = plans[
        max(
            range(len(plans)),
            key=lambda i: (wants[i], plans[i]["evaluation"]["docs_per_stratum_needed"]),
        )
    ]
    binding = {
        "model": first["model"],
        "action": first["action"],
        "estimand": first["estimand"],
        "K": planned,
        "docs_per_stratum_needed": first["evaluation"]["docs_per_stratum_needed"],
    }
    if worst:
        notes.append(
            f"more documents would be needed: at K = {K}, a half-width of {half_width:g} on "
            f"{worst[2]} at level {level:.6g} needs {worst[0]} evaluation documents per stratum "
            f"({worst[1]}), the config fixes {documents_per_stratum} (datasets.cohorts.{cohort})"
        )
    if pinned_K is None and bounded:
        pair, wider_K = max(bounded, key=lambda b: b[1])
        notes.append(
            f"K is bounded by analysis.planning.max_K = {max_K}: without the bound the "
            f"least-cost K of {pair} would be {wider_K}"
        )
    return {
        "estimand": "endpoints" if endpoints else "R_smc",
        "estimands": list(dict.fromkeys(e["estimand"] for e in plans)),
        "target_half_width": half_width,
        "level": level,
        "cost_units": COST_UNITS,
        "strata": strata,
        "cohort": cohort,
        "documents_per_stratum": documents_per_stratum,
        "max_K": max_K,
        "K": K,
        "K_planned": planned,
        "K_source": "config" if pinned_K is not None else "plan",
        "binding": binding,
        "notes": notes,
        "plans": plans,
        "measured": {"units": "seconds", "used": False, "pairs": measured},
    }
