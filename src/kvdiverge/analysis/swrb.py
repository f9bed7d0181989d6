"""Estimands from SWRB replicates, with the stratified paired document bootstrap.

`docs/method.md`, "Survival-weighted residual branching" and "Uncertainty". Per replicate, with
the trunk's survival weights w_s, M = Σ_s w_s, the entry J and the branch trajectory's mismatch
fraction D_J (the 1/H of step J included):

* Z^R = M·D_J (mean R_SMC), Z^O = M/H (mean O_H), Z^Π = M(D_J − 1/H) (mean Π_H);
* Z_L = M·(1/H) Σ_{j<ℓ_J} I_{J+j} (mean R_L) and W_L = M(H − J + 1 − ℓ_J)/H (mean B_L), with
  ℓ_J = min(L, H − J + 1);
* the smooth divergence CDF Σ_{s≤t} w_s (mean P(τ ≤ t)) and Σ_s s·w_s (mean E[τ·1{τ ≤ H}]),
  whose ratio to the mean of M is the mean entry time E[τ | τ ≤ H].

:func:`naive_replicate_values` gives the same columns from plain coupled rollouts (B = 1{τ ≤ H}
in place of M, τ in place of J, the indicator 1{τ ≤ t} in place of the smooth CDF), so both
estimators go through the same document means and bootstrap. A document's value is the mean over
its replicates; an estimand averages documents with equal weight (a ratio estimand is the ratio
of document-averaged numerator and denominator).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl

from kvdiverge.analysis.bootstrap import (
    MIN_INTERVAL_DOCUMENTS,
    percentile_interval,
    resampled_means,
    stratified_bootstrap_weights,
)
from kvdiverge.theory.survival import survival_weights

__all__ = [
    "SwrbTableError",
    "document_means",
    "estimates_from_records",
    "naive_replicate_values",
    "record_document_means",
    "swrb_estimates",
    "swrb_replicate_values",
    "swrb_study_table",
]


class SwrbTableError(ValueError):
    """The record files of a study cannot make its SWRB table; one line naming the file."""


def _window_terms(
    weight: np.ndarray, entry: np.ndarray, mismatch: np.ndarray, L: int
) -> tuple[np.ndarray, np.ndarray]:
    """Z_L = weight·(1/H) Σ_{j<ℓ} I_{entry+j} and W_L = weight·(H − entry + 1 − ℓ)/H."""
    H = mismatch.shape[1]
    t = np.arange(1, H + 1)[None, :]
    start = entry[:, None]
    inside = (t >= start) & (t < start + L)
    z_l = weight * (mismatch & inside).sum(1) / H
    remaining = np.clip(H - entry + 1, 0, None)
    return z_l, weight * (remaining - np.minimum(L, remaining)) / H


def _values(
    weight: np.ndarray,
    entry: np.ndarray,
    mismatch: np.ndarray,
    cdf: np.ndarray,
    entry_moment: np.ndarray,
    windows: Sequence[int],
) -> dict[str, np.ndarray]:
    H = mismatch.shape[1]
    D = mismatch.sum(1) / H
    has = entry <= H
    out = {
        "R_smc": weight * D,
        "O_H": weight * has / H,
        "Pi_H": weight * has * (D - 1 / H),
        "div_prob": weight * has,
        "entry_moment": entry_moment,
    }
    for L in windows:
        out[f"Z_L@{L}"], out[f"W_L@{L}"] = _window_terms(weight, entry, mismatch, L)
    for t in range(1, H + 1):
        out[f"div_cdf@{t}"] = cdf[:, t - 1]
    return out


def swrb_replicate_values(
    e: np.ndarray, entry: np.ndarray, mismatch: np.ndarray, windows: Sequence[int] = ()
) -> dict[str, np.ndarray]:
    """Per-replicate SWRB statistics (module docstring) from the trunk's e (k, H), J (k,) and
    the branch trajectory's mismatches (k, H); each value's mean is its estimand."""
    e = np.asarray(e, dtype=np.float64)
    mismatch = np.asarray(mismatch, dtype=bool)
    w, M = survival_weights(e)
    steps = np.arange(1, e.shape[1] + 1)
    return _values(M, np.asarray(entry), mismatch, np.cumsum(w, axis=1), w @ steps, windows)


def naive_replicate_values(
    mismatch: np.ndarray, windows: Sequence[int] = ()
) -> dict[str, np.ndarray]:
    """The same statistics from plain coupled rollouts' mismatches (k, H): B·D_H, B/H,
    B(D_H − 1/H), 1{τ ≤ t}, τ·1{τ ≤ H}, and Z_L, W_L at the first divergence."""
    mismatch = np.asarray(mismatch, dtype=bool)
    H = mismatch.shape[1]
    has = mismatch.any(1)
    tau = np.where(has, mismatch.argmax(1) + 1, H + 1)
    cdf = (tau[:, None] <= np.arange(1, H + 1)[None, :]).astype(np.float64)
    return _values(has.astype(np.float64), tau, mismatch, cdf, np.where(has, tau, 0.0), windows)


def document_means(values: dict[str, np.ndarray], documents: np.ndarray) -> pl.DataFrame:
    """Per document (in order of first appearance): the mean of every statistic over its
    replicates, with ``n_replicates``."""
    documents = np.asarray(documents)
    order, index = np.unique(documents, return_inverse=True)
    counts = np.bincount(index)
    columns = {"doc_id": order.tolist(), "n_replicates": counts}
    for name, v in values.items():
        columns[name] = np.bincount(index, weights=np.asarray(v, dtype=np.float64)) / counts
    return pl.DataFrame(columns)


def swrb_estimates(
    doc_means: pl.DataFrame,
    strata: Sequence[str],
    draws: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> pl.DataFrame:
    """Estimands pooled over documents, with percentile intervals from the stratified document
    bootstrap (:mod:`kvdiverge.analysis.bootstrap`): every statistic of :func:`document_means`
    averaged over documents, and ``mean_entry_time`` = mean(entry_moment) / mean(div_prob).
    Returns columns estimand, value, lo, hi."""
    stats = [c for c in doc_means.columns if c not in ("doc_id", "n_replicates")]
    X = doc_means.select(stats).to_numpy().astype(np.float64)
    weights = stratified_bootstrap_weights(np.asarray(strata), draws, seed)
    boot = resampled_means(weights, X)
    point = X.mean(0)
    i_num, i_den = stats.index("entry_moment"), stats.index("div_prob")

    def ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)

    names = [*stats, "mean_entry_time"]
    point = np.append(point, ratio(point[i_num], point[i_den]))
    boot = np.column_stack([boot, ratio(boot[:, i_num], boot[:, i_den])])
    lo, hi = percentile_interval(boot, level)
    return pl.DataFrame({"estimand": names, "value": point, "lo": lo, "hi": hi})


def estimates_from_records(
    paths: Mapping[str, str | os.PathLike],
    strata: Mapping[str, str],
    windows: Sequence[int] = (),
    draws: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> pl.DataFrame:
    """Estimands of SWRB record files (:mod:`kvdiverge.io.swrb_records`, read and checked), per
    action: pooled over all documents (``stratum`` = ``all``) and per stratum, each with its
    bootstrap interval (:func:`swrb_estimates`; one bootstrap seed per action, so actions of one
    run share draws when their documents agree). ``paths``: action → record file;
    ``strata``: doc_id → stratum. Columns action, stratum, estimand, value, lo, hi."""
    from kvdiverge.io.swrb_records import read_swrb_records, record_arrays

    tables = []
    for action, path in paths.items():
        a = record_arrays(read_swrb_records(path, role={"action": action}))
        mismatch = a["x_token"] != a["y_token"]
        values = swrb_replicate_values(a["e"], a["J"].astype(np.int64), mismatch, windows)
        means = document_means(values, a["doc_id"])
        missing = [d for d in means["doc_id"] if d not in strata]
        if missing:
            raise ValueError(f"strata: no stratum for doc_id {missing[0]!r} of {path}")
        labels = [strata[d] for d in means["doc_id"]]
        parts = [("all", means, labels)]
        for stratum in sorted(set(labels)):
            keep = [label == stratum for label in labels]
            parts.append((stratum, means.filter(pl.Series(keep)), [stratum] * sum(keep)))
        for stratum, frame, frame_strata in parts:
            table = swrb_estimates(frame, frame_strata, draws, seed, level)
            tables.append(
                table.select(
                    pl.lit(action).alias("action"), pl.lit(stratum).alias("stratum"), pl.all()
                )
            )
    return pl.concat(tables)


def record_document_means(
    path: str | os.PathLike, windows: Sequence[int] = (), role: Mapping[str, Any] | None = None
) -> pl.DataFrame:
    """:func:`document_means` of one SWRB record file (read and checked, and against ``role``:
    :func:`kvdiverge.io.swrb_records.check_swrb_role`), with ``n_replicates`` per document."""
    from kvdiverge.io.swrb_records import read_swrb_records, record_arrays

    a = record_arrays(read_swrb_records(path, role=role))
    if a["doc_id"].size == 0:
        raise SwrbTableError(f"{path}: no SWRB records")
    mismatch = a["x_token"] != a["y_token"]
    values = swrb_replicate_values(a["e"], a["J"].astype(np.int64), mismatch, windows)
    return document_means(values, a["doc_id"])


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def swrb_study_table(
    files: Mapping[str, Mapping[str, Mapping[str, str | os.PathLike]]],
    contrasts: Sequence[Sequence[str]] = (),
    windows: Sequence[int] = (),
    draws: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    role: Mapping[str, Any] | None = None,
) -> pl.DataFrame:
    """One study's SWRB estimands in the layout of ``estimands.csv`` (module docstring).

    ``files``: model → action → stratum → record file (every action of a model over the same
    documents: the bootstrap pairs them). Per model, documents are ordered by (stratum, doc_id)
    and resampled within strata (:func:`kvdiverge.analysis.bootstrap.stratified_bootstrap_weights`
    seeded by ``seed``; the draws of a stratum's rows are the same draws restricted to it). Rows:
    per action (``contrast`` empty) and per contrast ``b - a`` of ``contrasts`` [b, a]
    (``action`` empty), stratum ``pooled`` and each stratum, every statistic of
    :func:`swrb_replicate_values` (``Z_L@L``, ``W_L@L`` for each L of ``windows``) and
    ``mean_entry_time``; ``n_docs``, ``n_paths`` (replicates; both sides' for a contrast) and
    ``draws_dropped`` (draws where a ratio is undefined, left out of the interval).

    Each file is read as the record file of its model, action and stratum (where ``files`` puts
    it) and of ``role``'s study and cohort, where given: a file whose metadata or documents say
    otherwise stops in one line (:func:`kvdiverge.io.roles.role_problem`).
    """
    from kvdiverge.analysis.estimands import ESTIMAND_COLUMNS

    frames = []
    for model, by_action in files.items():
        actions = list(by_action)
        for b, a in contrasts:
            if b not in by_action or a not in by_action:
                raise SwrbTableError(
                    f"model {model}: contrast {b} - {a} names an action without records"
                )
        means: dict[str, pl.DataFrame] = {}
        for action, by_stratum in by_action.items():
            parts = [
                record_document_means(
                    path,
                    windows,
                    {**(role or {}), "model": model, "action": action, "stratum": stratum},
                ).with_columns(stratum=pl.lit(stratum))
                for stratum, path in by_stratum.items()
            ]
            means[action] = pl.concat(parts).sort("stratum", "doc_id")
        reference = means[actions[0]].select("stratum", "doc_id")
        for action, frame in means.items():
            if not frame.select("stratum", "doc_id").equals(reference):
                first = next(iter(by_action[action].values()))
                raise SwrbTableError(
                    f"{first}: model {model}, action {action}: its documents differ from action "
                    f"{actions[0]}'s; the paired bootstrap needs the same documents"
                )
        skip = ("doc_id", "n_replicates", "stratum")
        stats = [c for c in means[actions[0]].columns if c not in skip]
        labels = reference["stratum"].to_numpy()
        boot = stratified_bootstrap_weights(labels, draws, np.random.SeedSequence(seed))
        weights = np.vstack([np.ones((1, labels.size)), boot])  # row 0: the point estimate
        i_num, i_den = stats.index("entry_moment"), stats.index("div_prob")
        names = [*stats, "mean_entry_time"]
        for stratum in [None, *sorted(set(labels))]:
            cols = np.ones(labels.size, bool) if stratum is None else labels == stratum
            w = weights[:, cols]
            cube = {}  # action → (draws + 1, estimands)
            for action, frame in means.items():
                m = resampled_means(w, frame.select(stats).to_numpy()[cols])
                cube[action] = np.column_stack([m, _ratio(m[:, i_num], m[:, i_den])])
            paths = {a: int(f["n_replicates"].to_numpy()[cols].sum()) for a, f in means.items()}
            units = [(a, "", cube[a], paths[a]) for a in actions]
            units += [
                ("", f"{b} - {a}", cube[b] - cube[a], paths[b] + paths[a]) for b, a in contrasts
            ]
            for action, contrast, values, n_paths in units:
                lo, hi = percentile_interval(values[1:], level)
                if cols.sum() < MIN_INTERVAL_DOCUMENTS:  # one document: no interval
                    lo, hi = np.full_like(lo, np.nan), np.full_like(hi, np.nan)
                frames.append(
                    pl.DataFrame(
                        {
                            "model": model,
                            "action": action,
                            "contrast": contrast,
                            "stratum": "pooled" if stratum is None else stratum,
                            "estimand": names,
                            "value": values[0],
                            "ci_low": lo,
                            "ci_high": hi,
                            "ci_level": float(level),
                            "n_docs": int(cols.sum()),
                            "n_paths": n_paths,
                            "draws_dropped": (~np.isfinite(values[1:])).sum(0).astype(np.int64),
                        }
                    )
                )
    if not frames:
        raise SwrbTableError("no SWRB record files")
    return pl.concat(frames).select(ESTIMAND_COLUMNS)
