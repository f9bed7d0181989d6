"""Every estimand, pooled and per stratum, with paired bootstrap intervals.

Documented in `docs/method.md`, "Estimands", "Contrasts" and "Uncertainty".

Each estimand is a function of document means of the statistics of
:mod:`kvdiverge.analysis.document_stats` ("documents weigh equally; a ratio estimand is the
ratio of document-averaged numerator and denominator"). All functions here are vectorized over
a leading axis of actions and a trailing axis of bootstrap draws (draw 0 is the observed
sample), so the whole table is a few matrix products and one partial sort.

Estimand names (the ``estimand`` column of ``estimands.csv``), per action:

* timing and occupation: ``R_smc``, ``O_H``, ``E_H``, ``C_H``, ``Pi_H``,
  ``div_prob`` = P(τ ≤ H), ``mean_entry_time`` = E[τ | τ ≤ H], ``div_cdf@t`` = P(τ ≤ t);
* risks: ``R`` (rollout TV), ``F`` (fixed history), ``R_minus_F``;
* generation clock: ``tv@t`` = E[δ_t]; ``block_tv@a:b`` = |J|⁻¹ Σ_{t∈J} E[δ_t], whose contrast
  is g_J; ``block_tv_change`` = last block − first block, whose contrast is Δg;
* divergence clock: ``branch_cohort_fraction`` = P(τ ≤ d), ``branch_cohort_docs`` and
  ``branch_cohort_paths`` (counts), ``branch_tv@j`` = b_j, ``branch_early``, ``branch_late``,
  ``branch_contrast_B`` = B(a); pre-EOS: ``branch_pre_tv@j``, ``branch_pre_early``,
  ``branch_pre_late``, ``branch_pre_contrast_B`` (b^pre_J pools numerators and denominators
  over the window);
* ``S_99`` = (1/H) Σ_t P(δ_t > .99);
* EOS segments of R − F: ``rf_S0`` … ``rf_S3``, ``pre_eos_share`` = S0 / (R − F), ``eos_share``
  = 1 − pre_eos_share;
* local agreement in the branch cohort: ``local_agreement_run``, ``local_reentry``;
* Table 4: ``flat_extrapolation`` = mean I_t over steps 1..prefix, ``R_minus_flat``.

Contrasts ``b - a`` carry the difference of every estimand above (shares recomputed on the
differences) plus the gap decomposition ``gap_occurrence`` = ΔO_H, ``gap_exposure`` = ΔE_H·C̄_H,
``gap_rate`` = ΔC_H·Ē_H and their shares of ΔR_smc (``occurrence_share``, ``exposure_share``,
``rate_share``).

Pooling: a document's value of a statistic is the mean over its replicates (paths); an estimand
averages documents with equal weight, whatever their replicate counts, and the pooled rows
average all documents of all strata (so a stratum weighs by its document count). A ratio
estimand (``C_H``, ``mean_entry_time``, ``branch_*``, ``local_*``, the shares) is the ratio of
the document-averaged numerator and denominator, never a mean of per-document ratios.

No interval from fewer than two documents: a row whose unit rests on one document (a cohort
or stratum of one) gets a NaN interval, reported as not available (one document's resamples
all repeat it); the Markdown says so with the row's document count. The same holds for a ratio
estimand whose denominator fewer than two of the unit's documents carry (the branch cohort for
``branch_*`` and ``local_*``, the diverged paths for ``mean_entry_time``, the exposure for
``C_H``; :data:`RATIO_DENOMINATORS`): every resample then repeats that document's ratio. The
column ``denominator_docs`` counts the documents whose mean denominator is nonzero (for a
contrast, the fewer of its two actions'; ``n_docs`` for an estimand that is no ratio), and
``draws`` the bootstrap draws every interval of the table comes from.

Undefined draws: a ratio estimand is NaN where its denominator is zero (an empty branch
cohort, no divergence, a zero gap). Such bootstrap draws are left out of the percentile
interval, and the table's ``draws_dropped`` column counts them per row (0 when none). An
estimand whose every draw is undefined gets a NaN interval (``NA`` in the Markdown).
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Mapping, Sequence

import numpy as np
import polars as pl

from kvdiverge.analysis.bootstrap import (
    MIN_INTERVAL_DOCUMENTS,
    percentile_interval,
    stratified_bootstrap_weights,
)
from kvdiverge.analysis.document_stats import AnalysisInputError, Clock, stat_columns
from kvdiverge.analysis.estimand_registry import ESTIMANDS, ratio, ratio_denominators
from kvdiverge.io import atomic_path, atomic_write_text
from kvdiverge.theory.risk import gap_decomposition

__all__ = [
    "ESTIMAND_COLUMNS",
    "INTERVAL_COLUMNS",
    "RATIO_DENOMINATORS",
    "action_estimands",
    "all_pairs",
    "bootstrap_estimands",
    "contrast_estimands",
    "control_max_tv",
    "denominator_documents",
    "draws_line",
    "estimands_table",
    "render_markdown",
    "study_seed",
    "write_estimands",
]

ESTIMAND_COLUMNS = (
    "model",
    "action",
    "contrast",
    "stratum",
    "estimand",
    "value",
    "ci_low",
    "ci_high",
    "ci_level",
    "n_docs",
    "n_paths",
    "draws_dropped",
)

INTERVAL_COLUMNS = ("denominator_docs", "draws")
"""Columns of :func:`estimands_table` after :data:`ESTIMAND_COLUMNS` (module docstring)."""

_EXTRA = ("n_paths", "cohort_paths", "cohort_any")


_ratio = ratio  # num / den, NaN where the denominator is zero


def action_estimands(
    means: Mapping[str, np.ndarray], clock: Clock, n_docs: int
) -> dict[str, np.ndarray]:
    """Per-action estimands from document means (module docstring lists them): every
    ``action`` entry of :data:`kvdiverge.analysis.estimand_registry.ESTIMANDS`, in registry
    order, by its function.

    ``means[name]`` holds the document mean of statistic ``name`` with any shape (e.g.
    (actions, draws)); every result has that shape. ``n_docs`` scales the cohort counts.
    """
    out: dict[str, np.ndarray] = {}
    for entry in ESTIMANDS.values():
        if entry.computed_by != "action":
            continue
        value = entry.compute(means, clock, n_docs, out)
        if isinstance(value, Mapping):
            out.update(value)
        else:
            out[entry.column] = value
    return out


_COHORT = (("branch_cohort", 1.0),)
RATIO_DENOMINATORS: dict[str, tuple[tuple[tuple[str, float], ...], ...]] = ratio_denominators()
"""The denominators of the per-action ratio estimands without a lag: each a tuple of
denominators, each a sum of (document statistic, sign); a document carries the estimand's
denominators when each of them is nonzero in its mean (:func:`denominator_terms` adds the
lagged ones)."""


def denominator_terms(
    estimand: str, clock: Clock
) -> tuple[tuple[tuple[str, float], ...], ...] | None:
    """The denominators of a per-action ratio estimand (:data:`RATIO_DENOMINATORS`, and
    ``branch_tv@j`` over the branch cohort, ``branch_pre_tv@j`` over the pre-EOS paths at lag
    j, ``branch_pre_early`` / ``_late`` / ``_contrast_B`` over the pre-EOS paths of their
    windows); ``None`` for an estimand that is no ratio."""
    static = ratio_denominators()  # the registry's, estimands registered later included
    if estimand in static:
        return static[estimand]
    if estimand.startswith("branch_tv@"):
        return (_COHORT,)
    if estimand.startswith("branch_pre_tv@"):
        return (((f"branch_pre_n@{estimand.split('@')[1]}", 1.0),),)
    d, w = clock.branch_depth, clock.window
    early = tuple((f"branch_pre_n@{j}", 1.0) for j in range(1, w + 1))
    late = tuple((f"branch_pre_n@{j}", 1.0) for j in range(d - w + 1, d + 1))
    windows = {
        "branch_pre_early": (early,),
        "branch_pre_late": (late,),
        "branch_pre_contrast_B": (early, late),
    }
    return windows.get(estimand)


_CONTRAST_DENOMINATORS = {  # contrast-only ratios: documents where b's and a's values differ
    "occurrence_share": (("mismatch", 1.0),),
    "exposure_share": (("mismatch", 1.0),),
    "rate_share": (("mismatch", 1.0),),
    "pre_eos_share": (("rollout_tv", 1.0), ("fixed_tv", -1.0)),
    "eos_share": (("rollout_tv", 1.0), ("fixed_tv", -1.0)),
}


def denominator_documents(
    values: np.ndarray,
    names: Sequence[str],
    estimands: Sequence[str],
    clock: Clock,
    contrasts: Sequence[tuple[int, int]] = (),
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """How many documents carry each ratio estimand's denominator: per action ``{estimand:
    (n_actions,) counts}`` and per contrast ``{estimand: (n_contrasts,) counts}``; an estimand
    absent from both is no ratio and rests on every document.

    ``values`` (n_docs, n_actions, n_stats): each document's mean statistics, named ``names``;
    ``estimands``: the per-action estimand names; ``contrasts``: (b, a) action indices. A
    contrast of a ratio counts the fewer of its two actions' documents; a contrast's own
    shares (:data:`_CONTRAST_DENOMINATORS`) the documents whose denominator differs between b
    and a."""
    index = {n: i for i, n in enumerate(names)}

    def carried(terms: Sequence[tuple[str, float]]) -> np.ndarray:  # (n_docs, n_actions)
        return sum(sign * values[:, :, index[name]] for name, sign in terms)

    per_action: dict[str, np.ndarray] = {}
    for estimand in estimands:
        terms = denominator_terms(estimand, clock)
        if terms:
            per_action[estimand] = np.minimum.reduce([(carried(t) != 0).sum(0) for t in terms])
    b = np.array([c[0] for c in contrasts], dtype=np.int64)
    a = np.array([c[1] for c in contrasts], dtype=np.int64)
    per_contrast = {k: np.minimum(v[b], v[a]) for k, v in per_action.items()}
    if len(contrasts):
        for key, terms in _CONTRAST_DENOMINATORS.items():
            diff = carried(terms)
            per_contrast[key] = (diff[:, b] != diff[:, a]).sum(0)
    return per_action, per_contrast


_RECOMPUTED_SHARES = ("pre_eos_share", "eos_share")


def contrast_estimands(
    per_action: Mapping[str, np.ndarray], minuend: np.ndarray, subtrahend: np.ndarray
) -> dict[str, np.ndarray]:
    """Contrasts ``b − a`` of every per-action estimand, plus the gap decomposition.

    ``per_action[name]`` has actions on its first axis; ``minuend`` / ``subtrahend`` index it
    (one entry per contrast). ΔR_smc = ΔO_H + ΔE_H·C̄_H + ΔC_H·Ē_H holds exactly.
    """
    b, a = np.asarray(minuend), np.asarray(subtrahend)

    def diff(name: str) -> np.ndarray:
        return per_action[name][b] - per_action[name][a]

    out = {k: diff(k) for k in per_action if k not in _RECOMPUTED_SHARES}
    out["pre_eos_share"] = _ratio(out["rf_S0"], out["R_minus_F"])
    out["eos_share"] = 1 - out["pre_eos_share"]
    moments = ("O_H", "E_H", "Pi_H")
    gap = gap_decomposition(
        {k: per_action[k][a] for k in moments}, {k: per_action[k][b] for k in moments}
    )
    for term in ("occurrence", "exposure", "rate"):
        out[f"gap_{term}"] = gap[term]
        out[f"{term}_share"] = gap[f"{term}_share"]
    return out


def all_pairs(actions: Sequence[str]) -> list[tuple[str, str]]:
    """Every pair of distinct actions as (b, a) for the contrast ``b − a``, in list order."""
    return [(b, a) for b, a in itertools.combinations(actions, 2)]


def _aligned_matrix(
    stats: pl.DataFrame, actions: Sequence[str], clock: Clock, where: str
) -> tuple[pl.DataFrame, np.ndarray, list[str]]:
    """(documents, values[n_docs, n_actions, n_stats], stat names), documents aligned."""
    names = [*stat_columns(clock), *_EXTRA]
    stats = stats.with_columns(cohort_any=(pl.col("cohort_paths") > 0).cast(pl.Float64))
    docs = None
    blocks = []
    for action in actions:
        rows = stats.filter(pl.col("action") == action).sort("stratum", "doc_id")
        if rows.height == 0:
            raise AnalysisInputError(f"{where}: no documents for action {action!r}")
        if docs is None:
            docs = rows.select("doc_id", "stratum")
        elif not rows["doc_id"].equals(docs["doc_id"]):
            missing = sorted(set(docs["doc_id"]) ^ set(rows["doc_id"]))
            raise AnalysisInputError(
                f"{where}: action {action!r} covers different documents than {actions[0]!r} "
                f"(e.g. {missing[0]!r}); every action needs every document"
            )
        blocks.append(rows.select(names).to_numpy().astype(np.float64))
    return docs, np.stack(blocks, axis=1), names


def bootstrap_estimands(
    stats: pl.DataFrame,
    clock: Clock,
    actions: Sequence[str],
    contrasts: Sequence[tuple[str, str]],
    weights: np.ndarray,
    strata: str | None = None,
    where: str = "document stats",
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int, np.ndarray]:
    """Estimands under each weight row for the documents of one stratum (or all, ``None``).

    ``stats`` holds one (document, action) row per document of the analysed cohort;
    ``weights`` (draws, n_docs) are multiplicities over the documents ordered by (stratum,
    doc_id), the same for every action (paired). Returns (per-action estimands with shape
    (n_actions, draws), contrast estimands with shape (n_contrasts, draws), n_docs, paths per
    action).
    """
    docs, values, names = _aligned_matrix(stats, actions, clock, where)
    select = np.ones(docs.height, bool)
    if strata is not None:
        select = (docs["stratum"] == strata).to_numpy()
    if not select.any():
        raise AnalysisInputError(f"{where}: stratum {strata!r} has no documents")
    w = weights[:, select]
    v = values[select]
    n_docs, n_actions, n_stats = v.shape
    # (actions·stats, draws): each statistic's draws are contiguous
    flat = (v.reshape(n_docs, -1).T @ w.T) / w.sum(1)
    means_arr = flat.reshape(n_actions, n_stats, -1)
    means = {name: means_arr[:, i, :] for i, name in enumerate(names)}
    per_action = action_estimands(means, clock, n_docs)
    index = {a: i for i, a in enumerate(actions)}
    minuend = [index[b] for b, _ in contrasts]
    subtrahend = [index[a] for _, a in contrasts]
    per_contrast = contrast_estimands(per_action, minuend, subtrahend) if contrasts else {}
    paths = v[:, :, names.index("n_paths")].sum(0)
    return per_action, per_contrast, n_docs, paths


def estimands_table(
    stats: pl.DataFrame,
    clock: Clock,
    *,
    model: str,
    actions: Sequence[str],
    contrasts: Sequence[tuple[str, str]] | None = None,
    cohort: str | None = None,
    draws: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    family_estimands: Sequence[str] = (),
    family_size: int = 1,
    family_alpha: float = 0.05,
    control: str | None = None,
    strata: Sequence[str] | None = None,
    where: str = "document stats",
) -> pl.DataFrame:
    """The long ``estimands.csv`` table for one model: pooled and per-stratum rows, with contrasts.

    Only documents of ``cohort`` (all when ``None``) enter. Intervals are percentile intervals
    of a paired, stratified document bootstrap with ``draws`` draws (seeded); ``level`` is the
    pointwise coverage. The pooled rows of ``family_estimands`` for non-control actions get the
    family-adjusted level 1 − ``family_alpha``/``family_size`` (study 2's eight endpoints).
    Contrasts default to every pair of non-control actions. ``strata``, when given, lists the
    strata that must each hold documents of the cohort. ``where`` names the input in errors.

    ``draws_dropped`` counts, per row, the bootstrap draws (of ``draws``) in which the estimand
    is undefined (NaN: a ratio with a zero denominator); they are left out of the interval.
    """
    if cohort is not None:
        stats = stats.filter(pl.col("cohort") == cohort)
        if stats.height == 0:
            raise AnalysisInputError(f"{where}: cohort {cohort!r} has no documents")
    missing = [a for a in actions if a not in set(stats["action"])]
    if missing:
        raise AnalysisInputError(f"{where}: action {missing[0]!r} has no rows")
    compared = [a for a in actions if a != control]
    contrasts = all_pairs(compared) if contrasts is None else list(contrasts)
    docs, doc_values, stat_names = _aligned_matrix(stats, actions, clock, where)
    strata_labels = docs["stratum"].to_numpy()
    pair_index = [(actions.index(b), actions.index(a)) for b, a in contrasts]
    for stratum in strata or ():
        if stratum not in set(strata_labels):
            raise AnalysisInputError(f"{where}: stratum {stratum!r} has no documents")
    boot = stratified_bootstrap_weights(strata_labels, draws, np.random.SeedSequence(seed))
    weights = np.vstack([np.ones((1, docs.height)), boot])
    family_level = 1 - family_alpha / family_size
    frames = []
    for stratum in [None, *sorted(set(strata_labels))]:
        per_action, per_contrast, n_docs, paths = bootstrap_estimands(
            stats, clock, actions, contrasts, weights, stratum, where
        )
        label = "pooled" if stratum is None else stratum
        rows = slice(None) if stratum is None else strata_labels == stratum
        carriers = dict(
            zip(
                ("action", "contrast"),
                denominator_documents(
                    doc_values[rows], stat_names, list(per_action), clock, pair_index
                ),
                strict=True,
            )
        )
        for kind, table, names in (
            ("action", per_action, list(actions)),
            ("contrast", per_contrast, [f"{b} - {a}" for b, a in contrasts]),
        ):
            if not table:
                continue
            keys = list(table)
            cube = np.stack([table[k] for k in keys])  # (estimands, units, draws)
            n_units = cube.shape[1]
            levels = np.full((len(keys), n_units), level)
            if stratum is None and kind == "action" and family_size > 1:
                for i, k in enumerate(keys):
                    if k in family_estimands:
                        levels[i, [j for j, a in enumerate(names) if a != control]] = family_level
            draws_only = cube[..., 1:].reshape(-1, cube.shape[2] - 1)
            low, high = percentile_interval(draws_only, levels.ravel(), axis=1)
            # documents carrying each row's denominator (every document: no ratio)
            carrying = np.stack(
                [carriers[kind].get(k, np.full(n_units, n_docs)) for k in keys]
            ).ravel()
            # one document (of the unit, or carrying a ratio's denominator): no interval
            alone = carrying < MIN_INTERVAL_DOCUMENTS
            low, high = np.where(alone, np.nan, low), np.where(alone, np.nan, high)
            # bootstrap draws in which a ratio estimand is undefined (zero denominator, e.g. an
            # empty branch cohort): left out of the interval, and counted here
            dropped = (~np.isfinite(draws_only)).sum(1)
            unit_paths = (
                paths
                if kind == "action"
                else np.array(
                    [paths[actions.index(b)] + paths[actions.index(a)] for b, a in contrasts]
                )
            )
            frames.append(
                pl.DataFrame(
                    {
                        "model": model,
                        "action": np.tile(names if kind == "action" else [""] * n_units, len(keys)),
                        "contrast": np.tile(
                            [""] * n_units if kind == "action" else names, len(keys)
                        ),
                        "stratum": label,
                        "estimand": np.repeat(keys, n_units),
                        "value": cube[..., 0].ravel(),
                        "ci_low": low,
                        "ci_high": high,
                        "ci_level": levels.ravel(),
                        "n_docs": n_docs,
                        "n_paths": np.tile(unit_paths, len(keys)).astype(np.int64),
                        "draws_dropped": dropped.astype(np.int64),
                        "denominator_docs": carrying.astype(np.int64),
                        "draws": draws,
                    }
                )
            )
    return pl.concat(frames).select(*ESTIMAND_COLUMNS, *INTERVAL_COLUMNS)


def control_max_tv(stats: pl.DataFrame, control: str) -> float:
    """Largest document-mean E[δ_t] of the full-retention control (it must be 0)."""
    rows = stats.filter(pl.col("action") == control)
    if rows.height == 0:
        return 0.0
    return float(rows.select(pl.max_horizontal(pl.col("^delta@.*$").max())).item())


def study_seed(seed: int, study: str) -> int:
    """The bootstrap seed of a study: the master seed mixed with the study name."""
    return int(seed) * 1_000_003 + zlib.crc32(study.encode())


_MARKDOWN_STRATUM_ESTIMANDS = (
    "R_smc",
    "O_H",
    "E_H",
    "C_H",
    "Pi_H",
    "R_minus_F",
    "S_99",
    "branch_contrast_B",
    "block_tv_change",
    "exposure_share",
)


def render_markdown(table: pl.DataFrame, digits: int = 4, header: str | None = None) -> str:
    """A Markdown rendering of an estimands table: pooled scalar estimands, and per-stratum rows
    of the headline estimands (profiles ``name@t`` are in the CSV only). Undefined values and
    intervals show as ``NA``; "dropped draws" is the ``draws_dropped`` column. ``header``: a
    line above the table (the lock's registration, :func:`kvdiverge.analysis.prespecification.
    registration_line`)."""
    scalar = table.filter(~pl.col("estimand").str.contains("@"))
    keep = scalar.filter(
        (pl.col("stratum") == "pooled") | pl.col("estimand").is_in(_MARKDOWN_STRATUM_ESTIMANDS)
    )
    lines = [f"{header}", ""] if header else []
    if "draws" in table.columns and table.height:
        counts = sorted({int(d) for d in table["draws"].drop_nulls()})
        lines += [
            f"Intervals: percentile bootstrap over documents, "
            f"{', '.join(f'{d:,}' for d in counts)} draws; no interval where fewer than "
            f"{MIN_INTERVAL_DOCUMENTS} documents carry a row (or its ratio's denominator).",
            "",
        ]
    lines += [
        "| model | action | contrast | stratum | estimand | value | interval | level | docs "
        "| paths | dropped draws |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(x: float | None) -> str:
        return "NA" if x is None or not np.isfinite(x) else f"{x:.{digits}f}"

    def interval(r: dict) -> str:
        if r["n_docs"] < MIN_INTERVAL_DOCUMENTS:
            return f"not available ({r['n_docs']} document)"
        carrying = r.get("denominator_docs")
        if carrying is not None and carrying < MIN_INTERVAL_DOCUMENTS:
            return f"not available ({carrying} of {r['n_docs']} documents carry the denominator)"
        return f"[{fmt(r['ci_low'])}, {fmt(r['ci_high'])}]"

    for r in keep.iter_rows(named=True):
        lines.append(
            f"| {r['model']} | {r['action'] or ''} | {r['contrast'] or ''} | {r['stratum']} | "
            f"{r['estimand']} | {fmt(r['value'])} | {interval(r)} | "
            f"{r['ci_level']:.5g} | {r['n_docs']} | {r['n_paths']} | "
            f"{'NA' if r.get('draws_dropped') is None else r['draws_dropped']} |"
        )
    return "\n".join(lines) + "\n"


def draws_line(path: str) -> str:
    """One line giving the bootstrap draws of an ``estimands.csv``'s intervals (its ``draws``
    column), for the tables built from it; empty for a table without the column."""
    frame = pl.scan_csv(path, infer_schema_length=None)
    if "draws" not in frame.collect_schema().names():
        return ""
    draws = frame.select(pl.col("draws").drop_nulls().unique()).collect()["draws"]
    if draws.len() == 0:
        return ""
    counts = ", ".join(f"{int(d):,}" for d in sorted(draws))
    return f"Intervals: percentile bootstrap over documents, {counts} draws."


def write_estimands(
    table: pl.DataFrame, csv_path: str, md_path: str, header: str | None = None
) -> None:
    """Write the estimands table as CSV and its Markdown rendering (``header`` above it), both
    atomically."""
    with atomic_path(csv_path, suffix=".csv") as tmp:
        table.write_csv(tmp)
    atomic_write_text(md_path, render_markdown(table, header=header))
