"""Evaluation sample sizes from the development rollouts (`docs/method.md`, "Sample-size
planning"; `docs/prespecification.md`, "Fixed by the development stage").

For one action, a document's replicate-averaged token-mismatch fraction has variance
σ_b² + σ_w²/K: between-document variance σ_b² of the true document means (pooled within strata,
since the bootstrap resamples within strata) plus within-document path variance σ_w² over K
replicates. With n evaluation documents the pooled estimate has variance
V(n, K) = (σ_b² + σ_w²/K)/n. A document with K replicates costs c_doc + K·c_rep seconds (one
prefill and selection, then K decoded replicates).

Everything comes from the development cohort's trajectory files alone, written by the
development rollout jobs before any evaluation rollout runs. Variances (method of moments,
:func:`development_moments` and :func:`variance_components`): σ_w² from D_H and D_H² within
documents, σ_b² = within-stratum variance of document means minus σ_w²/K_dev, clipped at 0.
Costs come from the seconds the rollout engine measures where the work happens and records in
each trajectory file's metadata key ``timing`` (:func:`kvdiverge.engine.run_stratum_rollout_job`):
per action and (model, stratum) job, its documents and paths (replicates summed over documents)
and the seconds of the documents' prefills, of its selection and gather, and of its decoding.
Over the action's development files c_doc = Σ(prefill + selection seconds) / Σ documents and
c_rep = Σ decode seconds / Σ paths (:func:`cost_from_timing`). Attribution: a rollout job runs
every action of a study with ONE prefill per document; that prefill is charged in full to each
action (an evaluation run of the action alone would pay it), and the decode seconds of actions
sharing a reference stream X are split as the row-steps a solo run would decode (the engine's
``decode_seconds``: X rows, Y rows and Z rows after each split, X counted once in the shared
batch), so c_rep is the cost of one replicate of the action alone. Model loading (once per job,
not per document or replicate) is left out: it does not change the least-cost design.

Two designs per (model, non-control action):

* the least-cost design (:func:`optimal_design`): n·(c_doc + K·c_rep) minimised subject to
  z·sqrt(V(n, K)) ≤ half_width, with n a multiple of the number of strata (equal documents per
  stratum), by exhaustive search over K = 1..max_K; the continuous optimum
  K* = sqrt(c_doc σ_w² / (c_rep σ_b²)) is reported beside it;
* the evaluation design (:func:`evaluation_replicates`): the number of evaluation documents is
  fixed by the config (the workflow's jobs are known before it runs), so K is the smallest
  K ≤ max_K that reaches the half-width with those documents, or, when none does, the
  least-cost design's K (beyond it, replicates buy less precision per second than documents
  would) — and the plan then says in one line how many documents per stratum the target needs.

The study's evaluation K (:func:`study_plan`) is the largest evaluation K of its (model, action)
pairs, so that every action runs the same replicates of the same documents (paired contrasts
share the reference paths), unless the config pins K.

This module imports no other analysis module on purpose: a change to its code re-plans, and a
new plan re-locks the study and reruns its evaluation rollouts (`docs/prespecification.md`,
"Changing it honestly"), so nothing but planning code may change the plan.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import numpy as np
import polars as pl
from scipy.stats import norm

from kvdiverge.io.trajectories import (
    TrajectoryFormatError,
    read_trajectories,
    read_trajectory_metadata,
)

__all__ = [
    "PlanningError",
    "cost_from_timing",
    "development_moments",
    "evaluation_replicates",
    "optimal_design",
    "read_timing",
    "study_plan",
    "variance_components",
]

TIMING_FIELDS = ("documents", "paths", "prefill_seconds", "selection_seconds", "decode_seconds")


class PlanningError(ValueError):
    """A development trajectory file or a planning setting is unusable; one line."""


def read_timing(path: str | os.PathLike) -> dict[str, float]:
    """The measured ``timing`` of a trajectory file's metadata (module docstring)."""
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


def development_moments(path: str | os.PathLike, stratum: str) -> pl.DataFrame:
    """Per document of a development trajectory file: ``n_paths`` and the replicate means of
    D_H (``mismatch``) and D_H² (``mismatch_sq``), with its ``stratum``.

    The file is checked against its contract first
    (:func:`kvdiverge.io.trajectories.read_trajectories`: whole paths, replicate counts), so D_H
    is the mean of I_t over t = 1..H.
    """
    try:
        frame = read_trajectories(path, lazy=True)
    except TrajectoryFormatError as exc:
        raise PlanningError(str(exc)) from exc
    return (
        frame.group_by("doc_id", "replicate")
        .agg(d=pl.col("mismatch").cast(pl.Float64).mean())
        .group_by("doc_id")
        .agg(
            n_paths=pl.len(),
            mismatch=pl.col("d").mean(),
            mismatch_sq=(pl.col("d") ** 2).mean(),
        )
        .with_columns(stratum=pl.lit(stratum))
        .sort("doc_id")
        .collect()
    )


def cost_from_timing(timings: Sequence[Mapping[str, float]], where: str = "planning") -> dict:
    """c_doc and c_rep (seconds) of one action from its files' ``timing`` (module docstring).

    c_doc = Σ(prefill_seconds + selection_seconds) / Σ documents;
    c_rep = Σ decode_seconds / Σ paths.
    """
    docs = sum(t["documents"] for t in timings)
    paths = sum(t["paths"] for t in timings)
    if docs <= 0 or paths <= 0:
        raise PlanningError(f"{where}: timing counts no documents or no paths")
    per_doc = sum(t["prefill_seconds"] + t["selection_seconds"] for t in timings)
    return {
        "c_doc": float(per_doc / docs),
        "c_rep": float(sum(t["decode_seconds"] for t in timings) / paths),
    }


def variance_components(stats: pl.DataFrame, where: str = "development cohort") -> dict:
    """σ_b², σ_w² and the development K of D_H for one action (module docstring).

    ``stats``: one row per development document of the action (columns ``mismatch``,
    ``mismatch_sq``, ``n_paths``, ``stratum``; :func:`development_moments`).
    """
    if stats.height < 2:
        raise PlanningError(f"{where}: needs at least 2 development documents, has {stats.height}")
    k = stats["n_paths"].to_numpy().astype(np.float64)
    mean = stats["mismatch"].to_numpy()
    spread = stats["mismatch_sq"].to_numpy() - mean**2  # within-document, divisor K
    within = np.where(k > 1, spread * k / np.maximum(k - 1, 1), 0.0)
    sigma_w2 = float(np.clip(within, 0, None).mean())
    centred = stats.with_columns(dev=pl.col("mismatch") - pl.col("mismatch").mean().over("stratum"))
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
        "cost_seconds": float(cost[i]),
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
        "cost_seconds": n_docs * (cost["c_doc"] + K * cost["c_rep"]),
    }


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
) -> dict:
    """The sample-size plan of a study (module docstring), as a JSON-ready dict.

    ``development[(model, action, stratum)]``: the development trajectory file of that job,
    whose rows give the variances and whose ``timing`` metadata gives the costs;
    ``documents_per_stratum``: the evaluation documents the config fixes per stratum (of
    ``cohort``); ``pinned_K``: the config's K when it pins one (else the plan's K is used).

    Per model and non-control action: σ_b², σ_w², K_dev, c_doc, c_rep, the least-cost design
    (``K``, ``n_docs``, ``docs_per_stratum``, ``cost_seconds``, ``half_width``,
    ``K_continuous``), ``K_needed`` (:func:`evaluation_replicates` at the configured documents;
    ``None`` when none ≤ max_K suffices) and ``evaluation``: half-width and cost of the study's
    evaluation design with the documents per stratum that the target would need at its K.
    Top level: ``K`` (the evaluation K: ``pinned_K``, else ``K_planned``), ``K_planned`` (the
    largest of each pair's ``K_needed``, or its least-cost K where that is ``None``),
    ``K_source``, and ``notes``: one line each, when more documents would be needed and when
    ``max_K`` bounds the plan.
    """
    if documents_per_stratum < 1:
        raise PlanningError(
            f"planning: expected at least 1 evaluation document per stratum, "
            f"got {documents_per_stratum}"
        )
    models = list(dict.fromkeys(m for m, _, _ in development))
    strata = sorted({s for _, _, s in development})
    n_eval = documents_per_stratum * len(strata)
    z = _z(level)
    plans = []
    bounded: list[tuple[str, int]] = []  # (model/action, least-cost K above max_K)
    for model in models:
        for action in actions:
            if action == control:
                continue
            missing = [s for s in strata if (model, action, s) not in development]
            if missing:
                raise PlanningError(
                    f"planning: no development trajectory file for {(model, action, missing[0])}"
                )
            files = [development[(model, action, s)] for s in strata]
            where = f"planning {model}/{action}"
            cost = cost_from_timing([read_timing(f) for f in files], where=where)
            moments = pl.concat(
                [development_moments(f, s) for f, s in zip(files, strata, strict=True)]
            )
            var = variance_components(moments, where=f"{where}: development cohort")
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
            needed = evaluation_replicates(
                var["sigma_between2"], var["sigma_within2"], n_eval, half_width, level, max_K
            )
            entry = {"model": model, "action": action, **var, **cost, **design}
            if needed is None and design["K"] == max_K:  # is the least-cost K beyond the bound?
                wider = optimal_design(
                    var["sigma_between2"],
                    var["sigma_within2"],
                    cost["c_doc"],
                    cost["c_rep"],
                    half_width,
                    level,
                    n_strata=len(strata),
                    max_K=4 * max_K,
                    min_docs_per_stratum=min_docs_per_stratum,
                )
                if wider["K"] > max_K:
                    bounded.append((f"{model}/{action}", wider["K"]))
            plans.append({**entry, "K_needed": needed})
    if not plans:
        raise PlanningError("planning: no development trajectory files of a non-control action")
    planned = max(e["K_needed"] if e["K_needed"] is not None else e["K"] for e in plans)
    K = pinned_K if pinned_K is not None else planned
    notes = []
    worst = None
    for e in plans:
        e["evaluation"] = _half_width_and_cost(e, e, K, n_eval, z)
        per_doc = e["sigma_between2"] + e["sigma_within2"] / K
        need = int(-(-int(_documents_needed(per_doc, half_width, z)) // len(strata)))
        e["evaluation"]["docs_per_stratum_needed"] = need
        if need > documents_per_stratum and (worst is None or need > worst[0]):
            worst = (need, f"{e['model']}/{e['action']}")
    if worst:
        notes.append(
            f"more documents would be needed: at K = {K}, a half-width of {half_width:g} on "
            f"R_SMC needs {worst[0]} evaluation documents per stratum ({worst[1]}), the config "
            f"fixes {documents_per_stratum} (datasets.cohorts.{cohort})"
        )
    if pinned_K is None and bounded:
        pair, wider_K = max(bounded, key=lambda b: b[1])
        notes.append(
            f"K is bounded by analysis.planning.max_K = {max_K}: without the bound the "
            f"least-cost K of {pair} would be {wider_K}"
        )
    return {
        "estimand": "R_smc",
        "target_half_width": half_width,
        "level": level,
        "strata": strata,
        "cohort": cohort,
        "documents_per_stratum": documents_per_stratum,
        "max_K": max_K,
        "K": K,
        "K_planned": planned,
        "K_source": "config" if pinned_K is not None else "plan",
        "notes": notes,
        "plans": plans,
    }
