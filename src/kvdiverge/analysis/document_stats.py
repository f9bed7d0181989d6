"""Per-document sufficient statistics from trajectory files (`docs/architecture.md`, "File
contracts").

Every estimand (`docs/method.md`, "Estimands") is a document average, or a ratio of two document
averages, of the replicate-averaged per-path quantities computed here. The bootstrap resamples
rows of the table this module builds, never trajectories.

Per path (one (document, replicate) of one action), with τ the first divergence (H + 1 when
none), e_X / e_Y the first step at which X / Y has emitted EOS (H + 1 when never),
e = min(e_X, e_Y), e' = max(e_X, e_Y) and d the branch-cohort depth (64 at H = 128):

=====================  =====================================================================
column                 per-path value
=====================  =====================================================================
mismatch               D_H = (1/H) Σ_t I_t
mismatch_sq            D_H² (within-document variance for sample-size planning)
diverged               1{τ ≤ H}
tau_diverged           τ·1{τ ≤ H}
exposure               (H − τ)+ / H
post_mismatch          (1/H) Σ_{t>τ} I_t
rollout_tv             (1/H) Σ_t δ_t
fixed_tv               (1/H) Σ_t f_t
saturation             (1/H) Σ_t 1{δ_t > threshold}
div_cdf@t              1{τ ≤ t}, t = 1..H
delta@t                δ_t, t = 1..H
branch_cohort          1{τ ≤ d}
branch@j               1{τ ≤ d} δ_{τ+j}, j = 1..d
branch_pre@j           1{τ ≤ d, τ+j < e} δ_{τ+j}
branch_pre_n@j         1{τ ≤ d, τ+j < e}
rf_seg0..rf_seg3       (1/H) Σ_{t ∈ S_k} (δ_t − f_t), EOS segments S0..S3
local_run              1{τ ≤ d} · 1{≥ run consecutive agreements at τ < t < e}
local_reentry          1{τ ≤ d} · 1{a mismatch at τ < t2 < e after an agreement at τ < t1 < t2}
prefix_mismatch        (1/H) Σ_{t ≤ m} I_t, m = prediction prefix (32)
prefix_diverged        1{τ ≤ m}
prefix_x_eos           1{e_X ≤ m}
prefix_y_eos           1{e_Y ≤ m}
prefix_fixed           (1/H) Σ_{t ≤ m} f_t
=====================  =====================================================================

plus ``n_paths`` (replicates of the document) and ``cohort_paths`` (paths in the branch cohort).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import polars as pl

from kvdiverge.analysis.control import check_full_retention_control
from kvdiverge.analysis.statistic_registry import (
    STATISTICS,
    AnalysisInputError,
    Clock,
    PathArrays,
    statistic_columns,
)
from kvdiverge.io import read_verified_parquet, write_parquet_with_metadata
from kvdiverge.io.documents import (
    SOURCE_COLUMNS,
    DocumentsFormatError,
    check_rolled_out_from,
    read_documents_with_source,
)
from kvdiverge.io.roles import role_problem
from kvdiverge.io.trajectories import (
    TrajectoryFormatError,
    check_trajectory_role,
    read_trajectories,
    read_trajectory_metadata,
)

__all__ = [
    "AnalysisInputError",
    "Clock",
    "document_stats",
    "path_statistics",
    "read_document_stats",
    "stat_columns",
    "write_document_stats",
]

KEY_COLUMNS = ("doc_id", "action", "stratum", "cohort")


def clock_terms(
    key: str, H: int, settings: Mapping[str, Any], limit: int = 4096
) -> tuple[Any, int | None]:
    """What a refusal of the clock at horizon ``H`` tells the user: the fraction of H that
    ``key`` of :meth:`Clock.for_horizon` has (``settings``' value, else its default; None for
    no such key), and the smallest horizon above H (at most ``limit``) whose clock the same
    ``settings`` make (None when none does)."""
    parameter = inspect.signature(Clock.for_horizon).parameters.get(key)
    fraction = settings.get(key, None if parameter is None else parameter.default)
    for h in range(max(H, 1) + 1, limit + 1):
        try:
            Clock.for_horizon(h, **settings)
        except AnalysisInputError:
            continue
        return fraction, h
    return fraction, None


def stat_columns(clock: Clock) -> list[str]:
    """Names of the per-document statistic columns for ``clock``, in order: every statistic of
    :data:`kvdiverge.analysis.statistic_registry.STATISTICS`, in registry order."""
    return statistic_columns(clock)


def path_statistics(
    mismatch: np.ndarray,
    tv_rollout: np.ndarray,
    tv_fixed: np.ndarray,
    x_eos: np.ndarray,
    y_eos: np.ndarray,
    clock: Clock,
) -> np.ndarray:
    """Per-path statistics (rows: paths, columns: :func:`stat_columns`).

    Inputs are (n_paths, H) arrays of I_t, δ_t, f_t and the EOS flags (“has emitted EOS at or
    before t”). The table in the module docstring defines every built-in column; each is
    computed by its entry of :data:`kvdiverge.analysis.statistic_registry.STATISTICS`.
    """
    paths = PathArrays(mismatch, tv_rollout, tv_fixed, x_eos, y_eos, clock)
    n, h = paths.mismatch.shape
    if h != clock.H:
        raise AnalysisInputError(f"path_statistics: arrays have H = {h}, clock has H = {clock.H}")
    blocks = []
    for statistic in STATISTICS.values():
        width = len(statistic.columns(clock))
        values = np.asarray(statistic.compute(paths), dtype=np.float64)
        expected = (n,) if statistic.index is None else (n, width)
        if values.shape != expected and values.shape != (n, width):
            raise AnalysisInputError(
                f"statistic {statistic.column!r}: its function returned shape {values.shape} "
                f"for {n} paths, expected {expected}"
            )
        blocks.append(values.reshape(n, width))
    return np.column_stack(blocks)


def _documents_frame(documents: pl.DataFrame | str | os.PathLike | Sequence) -> pl.DataFrame:
    if isinstance(documents, pl.DataFrame):
        frames = [documents]
    else:
        paths = [documents] if isinstance(documents, (str, os.PathLike)) else list(documents)
        try:
            frames = [read_documents_with_source(p, columns=["stratum", "cohort"]) for p in paths]
        except DocumentsFormatError as exc:
            raise AnalysisInputError(str(exc)) from exc
    columns = ["doc_id", "stratum", "cohort"]
    columns += [c for c in SOURCE_COLUMNS if all(c in f.columns for f in frames)]
    out = pl.concat([f.select(columns) for f in frames])
    dup = out.filter(pl.col("doc_id").is_duplicated())
    if dup.height:
        raise AnalysisInputError(
            f"documents: doc_id {dup['doc_id'][0]!r} appears more than once in the documents tables"
        )
    return out


def _file_statistics(
    path: str | os.PathLike, clock: Clock | None, data: pl.DataFrame | None = None
) -> tuple[pl.DataFrame, int]:
    """Per-document averages of one trajectory file; returns (frame, H).

    ``data``: the file's table, already read and checked (:func:`read_trajectories`)."""
    meta = read_trajectory_metadata(path)
    data = read_trajectories(path) if data is None else data
    frame = data.select(
        "doc_id", "replicate", "t", "mismatch", "tv_rollout", "tv_fixed", "x_eos", "y_eos"
    ).sort("doc_id", "replicate", "t")
    if frame.height == 0:
        raise AnalysisInputError(f"{path}: trajectory file has no rows")
    h_data = int(frame["t"].max())
    h = int(meta.get("H", h_data))
    if h_data != h:
        raise AnalysisInputError(f"{path}: steps run to t = {h_data} but the metadata says H = {h}")
    if clock is not None and h != clock.H:
        raise AnalysisInputError(
            f"{path}: H = {h} differs from H = {clock.H} of the other trajectory files"
        )
    if frame.height % h:
        raise AnalysisInputError(
            f"{path}: {frame.height} rows are not whole paths: every (doc_id, replicate) must "
            f"have exactly one row for each t = 1..{h}"
        )
    n = frame.height // h
    t = frame["t"].to_numpy().reshape(n, h)
    rep = frame["replicate"].to_numpy().reshape(n, h)
    doc_code = frame["doc_id"].rank("dense").to_numpy().reshape(n, h)
    if not (
        (t == np.arange(1, h + 1)).all()
        and (rep == rep[:, :1]).all()
        and (doc_code == doc_code[:, :1]).all()
    ):
        raise AnalysisInputError(
            f"{path}: every (doc_id, replicate) must have exactly one row for each t = 1..{h}"
        )

    def grid(name: str) -> np.ndarray:
        return frame[name].to_numpy().reshape(n, h)

    clock = clock or Clock.for_horizon(h)
    per_path = path_statistics(
        grid("mismatch"), grid("tv_rollout"), grid("tv_fixed"), grid("x_eos"), grid("y_eos"), clock
    )
    codes = doc_code[:, 0]
    starts = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])
    counts = np.diff(np.r_[starts, n])
    sums = np.add.reduceat(per_path, starts, axis=0)
    means = sums / counts[:, None]
    names = stat_columns(clock)
    doc_ids = frame["doc_id"].gather(starts * h)
    out = pl.DataFrame({"doc_id": doc_ids, "n_paths": counts.astype(np.int32)}).hstack(
        pl.DataFrame(means, schema=names, orient="row")
    )
    out = out.with_columns(cohort_paths=pl.col("branch_cohort") * pl.col("n_paths"))
    return out, h


def document_stats(
    trajectory_files: Mapping[str, Sequence[str | os.PathLike]],
    documents: pl.DataFrame | str | os.PathLike | Sequence[str | os.PathLike],
    clock_settings: Mapping[str, object] | None = None,
    control: str | None = None,
    development: Collection[str] | None = None,
    role: Mapping[str, str] | None = None,
    cohorts: Mapping[str, Any] | None = None,
) -> tuple[pl.DataFrame, Clock]:
    """One row per (document, action) of replicate-averaged statistics.

    Returns the table and the :class:`Clock` its profile columns follow.

    ``trajectory_files`` maps each action to its trajectory files (one per stratum);
    ``documents`` gives each doc_id's stratum and cohort. ``clock_settings`` are
    keyword arguments of :meth:`Clock.for_horizon`. Every non-control action must cover the
    same documents; the control may cover more (it runs every document). ``development``: the
    actions that ran the development cohort ``dev`` (default: every action); the others (a
    study's later rollout groups, docs/compare.md, "Rollout groups") must cover the same
    documents outside it.

    Errors (one line naming the file): a missing column or wrong type, a broken file contract
    (:func:`kvdiverge.io.trajectories.check_trajectories`: values, column consistency, path and
    replicate counts, naming the document, replicate and step), mismatched H across files, a
    document absent from the documents table, an action missing for some documents, a file
    rolled out from another documents file than the one given (its recorded SHA-256 differs,
    :func:`kvdiverge.io.documents.check_rolled_out_from`; ``documents`` given as files). The
    control's files are checked first (`docs/method.md`, "The full-retention control"): δ ≠ 0 or
    X ≠ Y anywhere raises :class:`~kvdiverge.analysis.control.ControlCheckError` naming the
    document. Before all that, each file's metadata must name the action it is read as (and
    ``role``'s model and study, where given): two actions' files swapped under each other's
    names stop there in one line (:func:`kvdiverge.io.trajectories.check_trajectory_role`).
    ``cohorts``: each file's cohort where the caller knows it (path → a cohort name, or a
    collection of names): a file holding documents of another cohort (a development file
    copied over an evaluation file, or another study's) stops in one line naming it.
    """
    _check_roles(trajectory_files, role)
    if control is not None and control in trajectory_files:
        try:
            check_full_retention_control(trajectory_files[control])
        except TrajectoryFormatError as exc:
            raise AnalysisInputError(str(exc)) from exc
    docs = _documents_frame(documents)
    known = {os.path.normpath(p): c for p, c in (cohorts or {}).items()}
    settings = dict(clock_settings or {})
    clock: Clock | None = None
    per_action: dict[str, pl.DataFrame] = {}
    source: dict[tuple[str, str], str] = {}
    for action, paths in trajectory_files.items():
        parts = []
        for path in paths:
            try:
                data = read_trajectories(path)  # checked against the file contract once
                if (cohort := known.get(os.path.normpath(path))) is not None:
                    ids = data["doc_id"].unique()
                    check_trajectory_role(path, {}, {"cohort": cohort}, ids)
                if data.height == 0:
                    raise AnalysisInputError(f"{path}: trajectory file has no rows")
                check_rolled_out_from(
                    path,
                    read_trajectory_metadata(path),
                    data["doc_id"].unique(),
                    docs,
                    AnalysisInputError,
                )
                if clock is None:
                    h = int(read_trajectory_metadata(path).get("H", 0)) or int(data["t"].max())
                    clock = Clock.for_horizon(h, **settings)
                frame, _ = _file_statistics(path, clock, data)
            except TrajectoryFormatError as exc:
                raise AnalysisInputError(str(exc)) from exc
            unknown = frame.join(docs, on="doc_id", how="anti")
            if unknown.height:
                raise AnalysisInputError(
                    f"{path}: doc_id {unknown['doc_id'][0]!r} is not in the documents table"
                )
            for d in frame["doc_id"]:
                source[(action, d)] = str(path)
            parts.append(frame)
        if not parts:
            raise AnalysisInputError(f"action {action!r}: no trajectory files")
        stacked = pl.concat(parts)
        dup = stacked.filter(pl.col("doc_id").is_duplicated())
        if dup.height:
            raise AnalysisInputError(
                f"{source[(action, dup['doc_id'][0])]}: doc_id {dup['doc_id'][0]!r} appears in "
                f"more than one trajectory file of action {action!r}"
            )
        per_action[action] = stacked.with_columns(action=pl.lit(action))

    compared = [a for a in per_action if a != control]
    if compared:
        union = set().union(*(set(per_action[a]["doc_id"]) for a in compared))
        dev = set(docs.filter(pl.col("cohort") == "dev")["doc_id"])
        for a in compared:
            wanted = union if development is None or a in development else union - dev
            missing = sorted(wanted - set(per_action[a]["doc_id"]))
            if missing:
                files = sorted(
                    {source[(b, missing[0])] for b in compared if (b, missing[0]) in source}
                )
                raise AnalysisInputError(
                    f"action {a!r} lacks {len(missing)} document(s) present for other actions, "
                    f"e.g. {missing[0]!r} (in {files[0]}); its files: "
                    f"{', '.join(map(str, trajectory_files[a]))}"
                )
    out = pl.concat(list(per_action.values())).join(docs, on="doc_id", how="left")
    frame = out.select(*KEY_COLUMNS, "n_paths", "cohort_paths", *stat_columns(clock))
    return frame.sort("action", "stratum", "doc_id"), clock


def _check_roles(
    trajectory_files: Mapping[str, Sequence[str | os.PathLike]], role: Mapping[str, str] | None
) -> None:
    """Each file's metadata against the action it is read as, and ``role`` (one line)."""
    for action, paths in trajectory_files.items():
        for path in paths:
            try:
                meta = read_trajectory_metadata(path)
            except TrajectoryFormatError:
                continue  # a file that cannot be read is named when it is read (below)
            try:
                check_trajectory_role(path, meta, {**(role or {}), "action": action}, ())
            except TrajectoryFormatError as exc:
                raise AnalysisInputError(str(exc)) from exc


def write_document_stats(
    frame: pl.DataFrame,
    path: str | os.PathLike,
    clock: Clock,
    role: Mapping[str, str] | None = None,
) -> None:
    """Write a document-statistics table atomically, with its clock (and ``role``: the study
    and model it is of) as Parquet metadata, page checksums and digests
    (:func:`kvdiverge.io.parquet.write_parquet_with_metadata`)."""
    write_parquet_with_metadata(frame, path, {"clock": asdict(clock), **dict(role or {})})


def read_document_stats(
    path: str | os.PathLike, role: Mapping[str, str] | None = None
) -> tuple[pl.DataFrame, Clock]:
    """Read a table written by :func:`write_document_stats`, verified as written
    (:func:`kvdiverge.io.parquet.read_verified_parquet`); checks its columns, and ``role``
    (study, model) against the one it records (:func:`kvdiverge.io.roles.role_problem`: one
    model's file read as another's stops). Every failure is one :class:`AnalysisInputError`
    naming the file."""
    frame, metadata = read_verified_parquet(path, "document-stats file", AnalysisInputError)
    if role and (problem := role_problem(path, metadata, role, (), "document-stats file")):
        raise AnalysisInputError(problem)
    spec = metadata.get("clock")
    if not isinstance(spec, dict):
        raise AnalysisInputError(f"{path}: no kvdiverge.clock metadata (not a document-stats file)")
    try:
        clock = Clock(**{**spec, "blocks": tuple(tuple(b) for b in spec["blocks"])})
    except (TypeError, KeyError, ValueError) as exc:
        raise AnalysisInputError(f"{path}: kvdiverge.clock is not a clock ({exc})") from exc
    missing = [c for c in (*KEY_COLUMNS, "n_paths", *stat_columns(clock)) if c not in frame.columns]
    if missing:
        raise AnalysisInputError(
            f"{path}: missing document-stats column(s) {', '.join(missing[:5])}"
        )
    return frame, clock
