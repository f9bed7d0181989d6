"""Trajectory files: the Parquet contract, written atomically, checked when read.

One row per (document, replicate, step) with the coupled pair's tokens, I_t, δ_t and f_t, EOS
flags and cache sizes. File-level metadata (Parquet key-value) records the model, action spec,
H, K, seed, coupling mode, dtype, device and package version; a rollout job's files also what
computed them (:data:`PROVENANCE_FIELDS`: the kernel of each attention layout, the device,
dtype and library versions, with the model folder's digests and the code fingerprint;
:func:`provenance_mix` says when files of one study differ in them).

:func:`read_trajectories` checks every file against its contract (:func:`check_trajectories`),
so that no wrong value flows silently into an estimand: columns and types; no nulls; δ_t and
f_t finite and in [0, 1] (up to float rounding, :data:`TV_TOLERANCE`); ``mismatch`` equal to
``x_token != y_token``; EOS flags that stay true once set; 1 <= n_kept <= n_prompt; every path
(document, replicate) has each step t = 1..H once; replicates of a document are 0..k-1 with k
the metadata's ``K`` (of the document's cohort when ``K`` is per cohort, at most ``K`` when it
is one number); the number of documents equals the metadata's ``n_documents``; token ids >= 0
and below the metadata's ``vocab_size`` where it records one. An error is one line naming the
file, document, replicate and step. A reader that knows which file it expects (its model,
action, ...) passes ``role``: a file whose metadata or documents say another is refused
(:mod:`kvdiverge.io.roles`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import polars as pl

from kvdiverge.io.parquet import (
    read_parquet_metadata,
    read_verified_parquet,
    write_parquet_with_metadata,
)
from kvdiverge.io.roles import role_problem, token_ids_problem

__all__ = [
    "METADATA_KEYS",
    "PROVENANCE_FIELDS",
    "TRAJECTORY_SCHEMA",
    "TV_TOLERANCE",
    "TrajectoryFormatError",
    "check_trajectories",
    "check_trajectory_role",
    "provenance_mix",
    "read_trajectories",
    "read_trajectory_metadata",
    "write_trajectories",
]

TRAJECTORY_SCHEMA: dict[str, pl.DataType] = {
    "doc_id": pl.String,
    "replicate": pl.Int32,
    "t": pl.Int16,
    "x_token": pl.Int32,
    "y_token": pl.Int32,
    "mismatch": pl.Boolean,
    "tv_rollout": pl.Float32,
    "tv_fixed": pl.Float32,
    "x_eos": pl.Boolean,
    "y_eos": pl.Boolean,
    "n_prompt": pl.Int32,
    "n_kept": pl.Int32,
}

METADATA_KEYS = ("model", "revision", "action", "H", "K", "seed", "coupling", "dtype", "device")


TV_TOLERANCE = 1e-6
"""δ_t and f_t may leave [0, 1] by this much (a total variation summed in float arithmetic)."""


class TrajectoryFormatError(ValueError):
    """A trajectory file does not follow its contract (module docstring); one line."""


WHAT = "trajectory file"


def _conform(frame: pl.DataFrame, where: str) -> pl.DataFrame:
    missing = [c for c in TRAJECTORY_SCHEMA if c not in frame.columns]
    if missing:
        raise TrajectoryFormatError(f"{where}: missing trajectory column(s) {', '.join(missing)}")
    out = []
    for name, dtype in TRAJECTORY_SCHEMA.items():
        col = frame[name]
        if col.dtype != dtype:
            ok_int = col.dtype.is_integer() and dtype.is_integer()
            ok_float = col.dtype.is_float() and dtype.is_float()
            if not (ok_int or ok_float):
                raise TrajectoryFormatError(
                    f"{where}: column {name!r} has type {col.dtype}, expected {dtype}"
                )
            col = col.cast(dtype, strict=True)
        out.append(col)
    return pl.DataFrame(out)


def write_trajectories(
    frame: pl.DataFrame, path: str | os.PathLike, metadata: Mapping[str, Any]
) -> None:
    """Write a trajectory table to ``path`` atomically with its file-level metadata.

    ``metadata`` must hold every key of :data:`METADATA_KEYS`; values are stored as JSON.
    """
    missing = [k for k in METADATA_KEYS if k not in metadata]
    if missing:
        raise TrajectoryFormatError(f"{path}: metadata missing key(s) {', '.join(missing)}")
    write_parquet_with_metadata(_conform(frame, str(path)), path, metadata)


def read_trajectory_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The kvdiverge key-value metadata of a trajectory file, decoded from JSON and checked
    against the digest it was written with (:mod:`kvdiverge.io.parquet`)."""
    return read_parquet_metadata(path, WHAT, TrajectoryFormatError)


PROVENANCE_FIELDS = ("kernel", "device", "dtype", "libraries")
"""What computed a trajectory file, as its metadata records it (the rollout job's)."""


def provenance_mix(metadata: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per field of :data:`PROVENANCE_FIELDS` whose value differs between the files
    of ``metadata`` (by path): a study whose strata or models ran with different kernels,
    devices, dtypes or library versions, which the estimands step warns of. Each line names
    the field and every value with its number of files and one of them."""
    lines = []
    for field in PROVENANCE_FIELDS:
        seen: dict[str, list[str]] = {}
        for path, meta in metadata.items():
            value = json.dumps(meta.get(field), sort_keys=True)
            seen.setdefault(value, []).append(str(path))
        if len(seen) > 1:
            parts = [f"{v} ({len(files)} file(s), e.g. {files[0]})" for v, files in seen.items()]
            lines.append(f"the trajectory files mix {field}: {'; '.join(parts)}")
    return lines


def _path_of(row: Mapping[str, Any], step: bool = True) -> str:
    where = f"doc_id {row['doc_id']!r} replicate {row['replicate']}"
    return f"{where} step {row['t']}" if step else where


def _expected_replicates(doc_id: str, K: Any) -> tuple[int | None, int | None, str]:
    """(exact count, upper bound, description) of a document's replicates from metadata K."""
    if isinstance(K, Mapping) and K:
        parts = str(doc_id).split("/")
        cohort = parts[-2] if len(parts) >= 3 else None
        if cohort in K:
            return int(K[cohort]), None, f"K[{cohort}] = {K[cohort]}"
        return None, max(int(v) for v in K.values()), f"K = {dict(K)}"
    if isinstance(K, int) and not isinstance(K, bool):
        return None, K, f"K = {K}"
    return None, None, ""


def check_trajectories(
    data: pl.DataFrame | pl.LazyFrame, where: str, metadata: Mapping[str, Any] | None = None
) -> None:
    """Check a trajectory table (conformed to :data:`TRAJECTORY_SCHEMA`) against its contract
    (module docstring); :class:`TrajectoryFormatError` naming ``where`` and the first offending
    document, replicate and step. Lazy input stays lazy: only aggregates and the first offending
    rows are collected."""
    meta = dict(metadata or {})
    lf = data.lazy() if isinstance(data, pl.DataFrame) else data
    keys = ["doc_id", "replicate", "t"]
    nulls = lf.select(pl.all().null_count()).collect().row(0, named=True)
    for name, count in nulls.items():
        if count:
            raise TrajectoryFormatError(f"{where}: column {name!r} has {count} null value(s)")
    _check_token_ids(lf, where, meta)

    def out_of_range(name: str) -> pl.Expr:
        col = pl.col(name)
        return ~(col.is_finite() & col.is_between(-TV_TOLERANCE, 1 + TV_TOLERANCE))

    differ = pl.col("x_token") != pl.col("y_token")
    flags = {
        "tv_rollout": out_of_range("tv_rollout"),
        "tv_fixed": out_of_range("tv_fixed"),
        "mismatch": pl.col("mismatch") != differ,
        "n_kept": (pl.col("n_kept") < 1) | (pl.col("n_kept") > pl.col("n_prompt")),
    }
    bad = (
        lf.select(*keys, *(flag.alias(f"bad_{n}") for n, flag in flags.items()))
        .filter(pl.any_horizontal(*(pl.col(f"bad_{n}") for n in flags)))
        .sort(keys)
        .head(1)
        .collect()
    )
    if bad.height:
        row = bad.row(0, named=True)
        first = (
            lf.filter(
                (pl.col("doc_id") == row["doc_id"])
                & (pl.col("replicate") == row["replicate"])
                & (pl.col("t") == row["t"])
            )
            .collect()
            .row(0, named=True)
        )
        at = f"{where}: {_path_of(row)}"
        if row["bad_tv_rollout"]:
            raise TrajectoryFormatError(
                f"{at}: tv_rollout (δ) = {first['tv_rollout']}, expected a finite value in [0, 1]"
            )
        if row["bad_tv_fixed"]:
            raise TrajectoryFormatError(
                f"{at}: tv_fixed (f) = {first['tv_fixed']}, expected a finite value in [0, 1]"
            )
        if row["bad_mismatch"]:
            raise TrajectoryFormatError(
                f"{at}: mismatch = {first['mismatch']} contradicts x_token = {first['x_token']}, "
                f"y_token = {first['y_token']}"
            )
        raise TrajectoryFormatError(
            f"{at}: n_kept = {first['n_kept']}, expected 1..n_prompt = {first['n_prompt']}"
        )

    paths = (
        lf.group_by("doc_id", "replicate")
        .agg(
            n=pl.len(),
            t_min=pl.col("t").min(),
            t_max=pl.col("t").max(),
            t_unique=pl.col("t").n_unique(),
            x_first=pl.col("t").filter(pl.col("x_eos")).min(),
            x_count=pl.col("x_eos").sum(),
            y_first=pl.col("t").filter(pl.col("y_eos")).min(),
            y_count=pl.col("y_eos").sum(),
        )
        .sort("doc_id", "replicate")
        .collect()
    )
    if paths.height == 0:
        if meta.get("n_documents") not in (None, 0):
            raise TrajectoryFormatError(
                f"{where}: no rows, but the metadata says n_documents = {meta['n_documents']}"
            )
        return
    horizon = meta.get("H")
    horizon = int(horizon) if isinstance(horizon, int) else int(paths["t_max"].max())
    broken = paths.filter(
        (pl.col("n") != horizon)
        | (pl.col("t_min") != 1)
        | (pl.col("t_max") != horizon)
        | (pl.col("t_unique") != horizon)
    )
    if broken.height:
        row = broken.row(0, named=True)
        raise TrajectoryFormatError(
            f"{where}: {_path_of(row, step=False)}: {row['n']} rows with steps "
            f"{row['t_min']}..{row['t_max']}, expected exactly one row for each t = 1..{horizon}"
        )
    for side in ("x", "y"):
        first, count = pl.col(f"{side}_first"), pl.col(f"{side}_count")
        broken = paths.filter((count > 0) & (count != horizon - first + 1))
        if broken.height:
            row = broken.row(0, named=True)
            after = (
                lf.filter(
                    (pl.col("doc_id") == row["doc_id"])
                    & (pl.col("replicate") == row["replicate"])
                    & (pl.col("t") > row[f"{side}_first"])
                    & ~pl.col(f"{side}_eos")
                )
                .select(pl.col("t").min())
                .collect()
                .item()
            )
            raise TrajectoryFormatError(
                f"{where}: {_path_of(row, step=False)} step {after}: {side}_eos is false after "
                f"EOS at step {row[f'{side}_first']} (EOS flags stay true once set)"
            )
    docs = (
        paths.group_by("doc_id", maintain_order=True)
        .agg(k=pl.len(), r_min=pl.col("replicate").min(), r_max=pl.col("replicate").max())
        .sort("doc_id")
    )
    broken = docs.filter((pl.col("r_min") != 0) | (pl.col("r_max") != pl.col("k") - 1))
    if broken.height:
        row = broken.row(0, named=True)
        raise TrajectoryFormatError(
            f"{where}: doc_id {row['doc_id']!r}: replicates {row['r_min']}..{row['r_max']} in "
            f"{row['k']} paths, expected replicates 0..{row['k'] - 1}"
        )
    if "K" in meta:
        for doc_id, k in zip(docs["doc_id"], docs["k"], strict=True):
            exact, bound, text = _expected_replicates(doc_id, meta["K"])
            if (exact is not None and k != exact) or (bound is not None and k > bound):
                wanted = exact if exact is not None else f"at most {bound}"
                raise TrajectoryFormatError(
                    f"{where}: doc_id {doc_id!r}: {k} replicates, expected {wanted} "
                    f"(metadata {text})"
                )
    n_documents = meta.get("n_documents")
    if isinstance(n_documents, int) and n_documents != docs.height:
        raise TrajectoryFormatError(
            f"{where}: {docs.height} documents, but the metadata says n_documents = {n_documents}"
        )


def _check_token_ids(lf: pl.LazyFrame, where: str, meta: Mapping[str, Any]) -> None:
    """x_token and y_token in [0, vocab_size) (the metadata's, where it records one):
    :func:`kvdiverge.io.roles.token_ids_problem`."""
    bounds = lf.select(
        *(getattr(pl.col(c), f)().alias(f"{c}_{f}") for c in TOKENS for f in ("min", "max"))
    ).collect()
    for column in TOKENS:
        lowest, highest = bounds[f"{column}_min"][0], bounds[f"{column}_max"][0]
        if lowest is None:
            continue
        if problem := token_ids_problem(where, column, lowest, highest, meta.get("vocab_size")):
            raise TrajectoryFormatError(problem)


TOKENS = ("x_token", "y_token")


def check_trajectory_role(
    path: str | os.PathLike, metadata: Mapping[str, Any], role: Mapping[str, Any], doc_ids: Any
) -> None:
    """The file read as ``role`` (study, model, action, stratum, cohort) is that file: one
    :class:`TrajectoryFormatError` line otherwise (:func:`kvdiverge.io.roles.role_problem`)."""
    if problem := role_problem(path, metadata, role, doc_ids, WHAT):
        raise TrajectoryFormatError(problem)


def read_trajectories(
    path: str | os.PathLike,
    lazy: bool = False,
    check: bool = True,
    role: Mapping[str, Any] | None = None,
) -> pl.DataFrame | pl.LazyFrame:
    """Read a trajectory file and check it against its contract (module docstring).

    A missing column, a wrong type, a damaged file (page checksums and the digests it was
    written with, :func:`kvdiverge.io.parquet.read_verified_parquet`) or a broken contract
    raises :class:`TrajectoryFormatError` with one line naming the file (and the document,
    replicate and step). With ``lazy=True`` the verified table is returned as a LazyFrame.
    ``check=False`` skips the contract's value checks (the file is still verified).
    ``role``: what the reader expects the file to be (:func:`check_trajectory_role`).
    """
    frame, metadata = read_verified_parquet(
        path, WHAT, TrajectoryFormatError, conform=lambda data: _conform(data, str(path))
    )
    if role:
        check_trajectory_role(path, metadata, role, frame["doc_id"].unique())
    if check:
        check_trajectories(frame, str(path), metadata)
    return frame.lazy() if lazy else frame
