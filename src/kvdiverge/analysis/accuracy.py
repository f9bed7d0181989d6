"""Task accuracy beside divergence: X's and Y's accuracy per action, and by when the pair
diverged — an association, not a causal effect of the divergence time.

Each path's reference X (the full cache) and intervention Y (the action's cache) generations are
decoded with the model's tokenizer — the tokens before the first EOS, within the horizon H — and
scored against the document's gold answers with its source's own metric
(:mod:`kvdiverge.datasets.scoring`; the metric of a document follows from its stratum's dataset
environment, :mod:`kvdiverge.datasets.registry`). A path's divergence timing is *early* when
τ ≤ d (the branch depth of the analysis clock, H/2 by default), *late* when d < τ ≤ H and
*never* when X and Y agree at every step (then their scores are equal).

Per (document, action), replicate means of (module :data:`ACCURACY_STATS`):

==================  ==========================================================
column              per-path value
==================  ==========================================================
acc_x, acc_y        score of X, of Y
share@c             1{timing = c}, c ∈ {early, late, never}
acc_x@c, acc_y@c    1{timing = c}·score of X, of Y
==================  ==========================================================

Estimands (document means, documents weigh equally as in :mod:`kvdiverge.analysis.estimands`),
in the long format of ``estimands.csv`` (:data:`ESTIMAND_COLUMNS`): ``accuracy_x``,
``accuracy_y``, ``accuracy_drop`` = accuracy_x − accuracy_y (paired within documents: positive
when the action loses accuracy against the full cache), ``share@c``, and the ratio estimands
``accuracy_x@c``, ``accuracy_y@c`` (document-averaged numerator over document-averaged share;
undefined where no path has timing c) and ``accuracy_drop@c``. Intervals: the stratified paired
document bootstrap of :mod:`kvdiverge.analysis.bootstrap`, one weights matrix for every action,
so the drop's interval is paired.

Two caveats go with every table of these numbers (:data:`ACCURACY_CAVEATS`): the drop of a
*late* pair is small by construction (X and Y share the first d ≥ H/2 tokens, which carry most
answers), and τ depends on the coupling as well as on P and Q (another coupling of the same
kernels gives other divergence times), so accuracy by divergence timing describes an
association under this coupling, not what earlier divergence causes.

Namesakes by layer: this module computes the accuracy estimands;
:mod:`kvdiverge.tables.accuracy` formats them as Table A and :mod:`kvdiverge.plots.accuracy`
draws them (figure A).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl

from kvdiverge.analysis.bootstrap import (
    MIN_INTERVAL_DOCUMENTS,
    percentile_interval,
    stratified_bootstrap_weights,
)
from kvdiverge.analysis.document_stats import AnalysisInputError, Clock
from kvdiverge.analysis.estimands import ESTIMAND_COLUMNS
from kvdiverge.datasets.scoring import METRICS, score
from kvdiverge.io import atomic_path
from kvdiverge.io.documents import (
    DocumentsFormatError,
    check_rolled_out_from,
    read_documents_with_source,
)
from kvdiverge.io.trajectories import (
    TrajectoryFormatError,
    check_trajectory_role,
    read_trajectories,
    read_trajectory_metadata,
)
from kvdiverge.theory.risk import first_divergence

ACCURACY_CAVEATS = (
    "drop | late is small by construction: a pair that diverges after the branch depth d "
    "(H/2) shares its first d tokens, which carry most answers.",
    "τ depends on the coupling, not only on P and Q, so accuracy by divergence timing is an "
    "association under this coupling, not an effect of diverging earlier.",
)
"""The caveats stated under every accuracy table (module docstring)."""

__all__ = [
    "ACCURACY_CAVEATS",
    "ACCURACY_ESTIMANDS",
    "ACCURACY_STATS",
    "TIMING_CLASSES",
    "accuracy_document_stats",
    "accuracy_table",
    "document_metrics",
    "generated_text",
    "metric_documents",
    "path_scores",
    "timing_classes",
    "timing_depth",
    "write_accuracy",
]

TIMING_CLASSES: tuple[str, ...] = ("early", "late", "never")
"""Divergence timing of a path: τ ≤ d, d < τ ≤ H, no divergence within H."""

ACCURACY_STATS: tuple[str, ...] = (
    "acc_x",
    "acc_y",
    *(f"{q}@{c}" for c in TIMING_CLASSES for q in ("share", "acc_x", "acc_y")),
)
"""Per-(document, action) replicate means (module docstring)."""

ACCURACY_ESTIMANDS: tuple[str, ...] = (
    "accuracy_x",
    "accuracy_y",
    "accuracy_drop",
    *(f"{q}@{c}" for c in TIMING_CLASSES for q in ("share", "accuracy_x", "accuracy_y")),
    *(f"accuracy_drop@{c}" for c in TIMING_CLASSES),
)
"""Every estimand of the accuracy table, per action and stratum (module docstring)."""

_DOC_COLUMNS = ("doc_id", "stratum", "cohort", "answers", "metric")


def document_metrics(documents: pl.DataFrame, metric_of: Callable[[str, str], str]) -> pl.DataFrame:
    """The documents with a ``metric`` column: ``metric_of(stratum, task)`` per document (for
    the pipeline, the stratum's dataset environment's :meth:`metric`)."""
    pairs = documents.select("stratum", "task").unique()
    table = pairs.with_columns(
        metric=pl.Series([metric_of(s, t) for s, t in pairs.iter_rows()], dtype=pl.String)
    )
    return documents.join(table, on=["stratum", "task"], how="left")


def metric_documents(
    paths: Sequence[str | os.PathLike], datasets: Mapping[str, Any]
) -> pl.DataFrame:
    """The documents tables of ``paths`` with each document's ``metric``, named by its
    stratum's dataset environment under the ``datasets`` config section, and the file each
    comes from with its SHA-256 (:func:`kvdiverge.io.documents.read_documents_with_source`:
    :func:`accuracy_document_stats` refuses trajectories rolled out from other documents)."""
    from kvdiverge.datasets import DatasetsConfig
    from kvdiverge.datasets.registry import environment

    cfg = DatasetsConfig.from_config(datasets)
    try:
        frame = pl.concat([read_documents_with_source(p) for p in paths])
    except DocumentsFormatError as exc:
        raise AnalysisInputError(str(exc)) from exc

    def metric_of(stratum: str, task: str) -> str:
        s = cfg.stratum(stratum)
        return environment(s.env).metric(s, task)

    return document_metrics(frame, metric_of)


def timing_depth(H: int, clock: Mapping[str, Any] | None = None) -> int:
    """d, the early/late boundary: the branch depth of the analysis clock at horizon ``H``
    (:class:`kvdiverge.analysis.document_stats.Clock`; H/2 by default)."""
    return Clock.for_horizon(H, **dict(clock or {})).branch_depth


def generated_text(tokenizer: Any, tokens: Sequence[int], eos: Sequence[bool]) -> str:
    """The text of a generation: its tokens before the first EOS (``eos`` flags "EOS emitted at
    or before t"), decoded without special tokens."""
    flags = np.asarray(eos, dtype=bool)
    end = int(flags.argmax()) if flags.any() else len(flags)
    return tokenizer.decode([int(t) for t in tokens[:end]], skip_special_tokens=True)


def timing_classes(mismatch: np.ndarray, depth: int) -> np.ndarray:
    """Index into :data:`TIMING_CLASSES` of each path ((n_paths, H) mismatch flags): 0 when
    τ ≤ ``depth``, 1 when ``depth`` < τ ≤ H, 2 when never."""
    mism = np.asarray(mismatch, dtype=bool)
    tau = first_divergence(mism)
    return np.where(tau <= depth, 0, np.where(tau <= mism.shape[1], 1, 2))


def path_scores(
    trajectories: pl.DataFrame,
    documents: pl.DataFrame,
    tokenizer: Any,
    depth: int,
    where: str = "trajectories",
) -> pl.DataFrame:
    """One row per path (doc_id, replicate) of a trajectory table: ``timing`` (index into
    :data:`TIMING_CLASSES`), ``acc_x``, ``acc_y``, and the decoded ``x_text``, ``y_text``.

    ``documents`` holds ``doc_id``, ``answers`` and ``metric`` (:func:`document_metrics`).
    Identical token sequences are decoded and scored once.
    """
    frame = trajectories.sort("doc_id", "replicate", "t")
    if frame.height == 0:
        raise AnalysisInputError(f"{where}: no rows")
    h = int(frame["t"].max())
    n = frame.height // h
    docs = {r["doc_id"]: r for r in documents.iter_rows(named=True)}
    paths = frame.select("doc_id", "replicate").gather(np.arange(n) * h)
    missing = [d for d in paths["doc_id"].unique().to_list() if d not in docs]
    if missing:
        raise AnalysisInputError(f"{where}: doc_id {missing[0]!r} is not in the documents table")

    def grid(name: str) -> np.ndarray:
        return frame[name].to_numpy().reshape(n, h)

    x_tok, y_tok, x_eos, y_eos = grid("x_token"), grid("y_token"), grid("x_eos"), grid("y_eos")
    timing = timing_classes(grid("mismatch"), depth)
    texts: dict[tuple, str] = {}
    scores: dict[tuple, float] = {}

    def scored(doc: Mapping, tokens: np.ndarray, eos: np.ndarray) -> tuple[str, float]:
        key = (tuple(tokens.tolist()), tuple(eos.tolist()))
        if key not in texts:
            texts[key] = generated_text(tokenizer, tokens, eos)
        skey = (doc["doc_id"], key)
        if skey not in scores:
            scores[skey] = score(doc["metric"], texts[key], doc["answers"])
        return texts[key], scores[skey]

    rows = {"x_text": [], "y_text": [], "acc_x": [], "acc_y": []}
    for i, doc_id in enumerate(paths["doc_id"].to_list()):
        doc = docs[doc_id]
        xt, xs = scored(doc, x_tok[i], x_eos[i])
        yt, ys = scored(doc, y_tok[i], y_eos[i])
        rows["x_text"].append(xt)
        rows["y_text"].append(yt)
        rows["acc_x"].append(xs)
        rows["acc_y"].append(ys)
    return paths.with_columns(
        timing=pl.Series(timing, dtype=pl.Int8),
        acc_x=pl.Series(rows["acc_x"], dtype=pl.Float64),
        acc_y=pl.Series(rows["acc_y"], dtype=pl.Float64),
        x_text=pl.Series(rows["x_text"], dtype=pl.String),
        y_text=pl.Series(rows["y_text"], dtype=pl.String),
    )


def _document_means(scores: pl.DataFrame) -> pl.DataFrame:
    """Replicate means of :data:`ACCURACY_STATS` per document of a :func:`path_scores` table."""
    exprs = [pl.len().alias("n_paths"), pl.col("acc_x").mean(), pl.col("acc_y").mean()]
    for k, c in enumerate(TIMING_CLASSES):
        hit = (pl.col("timing") == k).cast(pl.Float64)
        exprs += [
            hit.mean().alias(f"share@{c}"),
            (hit * pl.col("acc_x")).mean().alias(f"acc_x@{c}"),
            (hit * pl.col("acc_y")).mean().alias(f"acc_y@{c}"),
        ]
    return scores.group_by("doc_id", maintain_order=True).agg(exprs)


def accuracy_document_stats(
    trajectories: Mapping[str, Sequence[str | os.PathLike | pl.DataFrame]],
    documents: pl.DataFrame,
    tokenizer: Any,
    depth: int,
    role: Mapping[str, Any] | None = None,
) -> pl.DataFrame:
    """One row per (document, action): ``doc_id``, ``action``, ``stratum``, ``cohort``,
    ``n_paths`` and :data:`ACCURACY_STATS`.

    ``trajectories`` maps each action to its trajectory files (read and checked against their
    contract) or tables; ``documents`` holds :data:`_DOC_COLUMNS` (``metric`` from
    :func:`document_metrics`); ``depth`` is d, the early/late boundary. One-line errors name
    the file; a trajectory file rolled out from another documents file than the one
    ``documents`` came from (:func:`metric_documents`) is refused naming both. Each file is
    read as the action it is listed under and as ``role`` (study, model, cohort: those given):
    a file whose metadata or documents say otherwise stops in one line
    (:func:`kvdiverge.io.trajectories.check_trajectory_role`).
    """
    missing = [c for c in _DOC_COLUMNS if c not in documents.columns]
    if missing:
        raise AnalysisInputError(f"documents: missing column(s) {', '.join(missing)}")
    unknown = sorted(set(documents["metric"].to_list()) - set(METRICS))
    if unknown:
        raise AnalysisInputError(f"documents: unknown metric(s) {', '.join(map(repr, unknown))}")
    docs = documents.select(_DOC_COLUMNS)
    parts = []
    for action, sources in trajectories.items():
        for source in sources:
            where = "trajectory table" if isinstance(source, pl.DataFrame) else str(source)
            try:
                data = source if isinstance(source, pl.DataFrame) else read_trajectories(source)
                if not isinstance(source, pl.DataFrame):
                    meta = read_trajectory_metadata(source)
                    ids = data["doc_id"].unique()
                    check_trajectory_role(source, meta, {**(role or {}), "action": action}, ids)
                    check_rolled_out_from(source, meta, ids, documents, AnalysisInputError)
            except TrajectoryFormatError as exc:
                raise AnalysisInputError(str(exc)) from exc
            means = _document_means(path_scores(data, docs, tokenizer, depth, where))
            parts.append(means.with_columns(action=pl.lit(action)))
    if not parts:
        raise AnalysisInputError("accuracy: no trajectory files")
    out = pl.concat(parts).join(docs.select("doc_id", "stratum", "cohort"), on="doc_id")
    return out.select("doc_id", "action", "stratum", "cohort", "n_paths", *ACCURACY_STATS).sort(
        "action", "stratum", "doc_id"
    )


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    out = np.full(np.broadcast_shapes(num.shape, den.shape), np.nan)
    np.divide(num, den, out=out, where=den != 0)
    return out


def _estimands(means: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every :data:`ACCURACY_ESTIMANDS` entry from resampled document means (any shape)."""
    out = {
        "accuracy_x": means["acc_x"],
        "accuracy_y": means["acc_y"],
        "accuracy_drop": means["acc_x"] - means["acc_y"],
    }
    for c in TIMING_CLASSES:
        share = means[f"share@{c}"]
        out[f"share@{c}"] = share
        out[f"accuracy_x@{c}"] = _ratio(means[f"acc_x@{c}"], share)
        out[f"accuracy_y@{c}"] = _ratio(means[f"acc_y@{c}"], share)
    for c in TIMING_CLASSES:
        out[f"accuracy_drop@{c}"] = out[f"accuracy_x@{c}"] - out[f"accuracy_y@{c}"]
    return {k: out[k] for k in ACCURACY_ESTIMANDS}


def accuracy_table(
    stats: pl.DataFrame,
    *,
    model: str,
    actions: Sequence[str],
    cohort: str | None = None,
    draws: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    where: str = "accuracy statistics",
) -> pl.DataFrame:
    """The long accuracy table of one model (:data:`ESTIMAND_COLUMNS`; ``contrast`` empty):
    every :data:`ACCURACY_ESTIMANDS` entry per action, pooled and per stratum, with percentile
    intervals of a paired stratified document bootstrap of ``draws`` draws (seeded).

    Only documents of ``cohort`` (all when None) enter, and every action must hold the same
    documents (paired). ``n_paths`` counts the action's paths.
    """
    if cohort is not None:
        stats = stats.filter(pl.col("cohort") == cohort)
    if stats.height == 0:
        raise AnalysisInputError(f"{where}: no documents of cohort {cohort!r}")
    per_action = {}
    for action in actions:
        rows = stats.filter(pl.col("action") == action).sort("doc_id")
        if rows.height == 0:
            raise AnalysisInputError(f"{where}: action {action!r} has no rows")
        per_action[action] = rows
    first = per_action[actions[0]]
    for action, rows in per_action.items():
        if rows["doc_id"].to_list() != first["doc_id"].to_list():
            raise AnalysisInputError(
                f"{where}: action {action!r} covers other documents than {actions[0]!r}"
            )
    strata = first["stratum"].to_numpy()
    boot = stratified_bootstrap_weights(strata, draws, np.random.SeedSequence(seed))
    weights = np.vstack([np.ones((1, first.height)), boot])  # draw 0: the sample
    frames = []
    for stratum in [None, *sorted(set(strata))]:
        sel = np.ones(first.height, bool) if stratum is None else strata == stratum
        w = weights[:, sel]
        for action, rows in per_action.items():
            values = rows.select(ACCURACY_STATS).to_numpy()[sel]
            resampled = (w @ values) / w.sum(1, keepdims=True)  # (draws + 1, stats)
            means = {s: resampled[:, j] for j, s in enumerate(ACCURACY_STATS)}
            table = _estimands(means)
            cube = np.stack([table[k] for k in ACCURACY_ESTIMANDS])  # (estimands, draws + 1)
            low, high = percentile_interval(cube[:, 1:], level, axis=1)
            if sel.sum() < MIN_INTERVAL_DOCUMENTS:  # one document: no interval (not available)
                low, high = np.full_like(low, np.nan), np.full_like(high, np.nan)
            frames.append(
                pl.DataFrame(
                    {
                        "model": model,
                        "action": action,
                        "contrast": "",
                        "stratum": "pooled" if stratum is None else stratum,
                        "estimand": list(ACCURACY_ESTIMANDS),
                        "value": cube[:, 0],
                        "ci_low": low,
                        "ci_high": high,
                        "ci_level": level,
                        "n_docs": int(sel.sum()),
                        "n_paths": int(rows["n_paths"].to_numpy()[sel].sum()),
                        "draws_dropped": (~np.isfinite(cube[:, 1:])).sum(1),
                    }
                )
            )
    return pl.concat(frames, how="vertical_relaxed").select(ESTIMAND_COLUMNS)


def write_accuracy(table: pl.DataFrame, csv_path: str | os.PathLike) -> None:
    """Write the accuracy table as CSV, atomically."""
    with atomic_path(csv_path, suffix=".csv") as tmp:
        table.write_csv(tmp)
