"""The documents table: its contract, its writer and its one reader.

One Parquet file per stratum, ``<output_dir>/documents/{stratum}.parquet``, written by rule
``materialize_documents`` (`docs/architecture.md`, "File contracts"): one row per document with
the columns of :data:`DOCUMENTS_SCHEMA`, ``doc_id`` unique. Every stage that reads documents
(the rollout job, the document statistics, accuracy) reads them with :func:`read_documents`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from kvdiverge import __version__
from kvdiverge.io import atomic_path

__all__ = ["DOCUMENTS_SCHEMA", "DocumentsFormatError", "read_documents", "write_documents"]

DOCUMENTS_SCHEMA: dict[str, pl.DataType] = {
    "doc_id": pl.String,
    "stratum": pl.String,
    "env": pl.String,
    "length_label": pl.String,
    "target_tokens": pl.Int64,
    "task": pl.String,
    "cohort": pl.String,
    "prompt": pl.String,
    "answers": pl.List(pl.String),
    "source": pl.String,
    "seed": pl.Int64,
    "n_tokens": pl.Int64,
}
"""The documents contract's columns, plus ``n_tokens``: the prompt's chat-wrapped length under
the length tokenizer (the engine recomputes n per model)."""


class DocumentsFormatError(ValueError):
    """A documents file does not follow `docs/architecture.md`, "File contracts"."""


def write_documents(
    frame: pl.DataFrame, path: str | os.PathLike, metadata: Mapping[str, Any] | None = None
) -> None:
    """Write a documents table atomically, with JSON key-value metadata."""
    table = frame.select(list(DOCUMENTS_SCHEMA)).cast(DOCUMENTS_SCHEMA).to_arrow()
    meta = {b"kvdiverge.version": __version__.encode()}
    for k, v in (metadata or {}).items():
        meta[f"kvdiverge.{k}".encode()] = json.dumps(v, default=str).encode()
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
    with atomic_path(path, suffix=".parquet") as tmp:
        pq.write_table(table, tmp)


def read_documents(path: str | os.PathLike, columns: Sequence[str] | None = None) -> pl.DataFrame:
    """Read and check a documents table: all of :data:`DOCUMENTS_SCHEMA`'s columns, or only
    ``columns`` (``doc_id`` is always read), cast to the contract's types.

    Raises :class:`DocumentsFormatError` in one line naming the file when it is not a readable
    Parquet file, lacks a wanted column, or repeats a ``doc_id``.
    """
    wanted = (
        list(DOCUMENTS_SCHEMA) if columns is None else list(dict.fromkeys(["doc_id", *columns]))
    )
    unknown = [c for c in wanted if c not in DOCUMENTS_SCHEMA]
    if unknown:
        raise ValueError(f"read_documents: no document column(s) {', '.join(unknown)}")
    try:
        names = pq.read_schema(path).names
    except (OSError, pa.ArrowInvalid) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DocumentsFormatError(
            f"{path}: not a readable documents Parquet file ({reason})"
        ) from exc
    missing = [c for c in wanted if c not in names]
    if missing:
        raise DocumentsFormatError(
            f"{path}: missing document column(s): the table lacks column(s) {', '.join(missing)}"
        )
    frame = pl.read_parquet(path, columns=wanted)
    if frame["doc_id"].n_unique() != frame.height:
        raise DocumentsFormatError(f"{path}: doc_id values are not unique")
    return frame.cast({c: DOCUMENTS_SCHEMA[c] for c in wanted})
