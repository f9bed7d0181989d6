"""Trajectory files: the Parquet contract of DESIGN §3.2, written atomically, validated on read.

One row per (document, replicate, step) with the coupled pair's tokens, I_t, δ_t and f_t
(SPEC §1), EOS flags and cache sizes. File-level metadata (Parquet key-value) records the model,
action spec, H, K, seed, coupling mode, dtype, device and package version.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from kvdiverge import __version__
from kvdiverge.io import atomic_path

__all__ = [
    "METADATA_KEYS",
    "TRAJECTORY_SCHEMA",
    "TrajectoryFormatError",
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

_META_PREFIX = "kvdiverge."


class TrajectoryFormatError(ValueError):
    """A trajectory file does not follow DESIGN §3.2."""


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
    table = _conform(frame, str(path)).to_arrow()
    meta = {f"{_META_PREFIX}{k}": json.dumps(v, sort_keys=True) for k, v in metadata.items()}
    meta[f"{_META_PREFIX}package_version"] = json.dumps(__version__)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
    with atomic_path(path, suffix=".parquet") as tmp:
        pq.write_table(table, tmp, compression="zstd")


def read_trajectory_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The kvdiverge key-value metadata of a trajectory file, decoded from JSON."""
    try:
        raw = pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowInvalid) as exc:
        raise TrajectoryFormatError(f"{path}: not a readable Parquet file ({exc})") from exc
    out = {}
    for k, v in raw.items():
        key = k.decode()
        if key.startswith(_META_PREFIX):
            out[key[len(_META_PREFIX) :]] = json.loads(v.decode())
    return out


def read_trajectories(path: str | os.PathLike, lazy: bool = False) -> pl.DataFrame | pl.LazyFrame:
    """Read and validate a trajectory file (columns and types of DESIGN §3.2).

    A missing column or a wrong type raises :class:`TrajectoryFormatError` naming the file.
    With ``lazy=True`` the schema is still checked eagerly, and a LazyFrame is returned.
    """
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise TrajectoryFormatError(f"{path}: not a readable Parquet file ({exc})") from exc
    empty = pl.from_arrow(schema.empty_table())
    _conform(empty, str(path))
    if lazy:
        return pl.scan_parquet(path).select(
            [pl.col(n).cast(d) for n, d in TRAJECTORY_SCHEMA.items()]
        )
    return _conform(pl.read_parquet(path), str(path))
