"""The documents table: its contract, its writer and its one reader.

One Parquet file per stratum, ``<output_dir>/documents/{stratum}.parquet``, written by rule
``materialize_documents`` (`docs/architecture.md`, "File contracts"): one row per document with
the columns of :data:`DOCUMENTS_SCHEMA`, ``doc_id`` unique. Every stage that reads documents
(the rollout job, the document statistics, accuracy) reads them with :func:`read_documents`,
verified against the page checksums and digests they were written with
(:mod:`kvdiverge.io.parquet`). Each rollout file records the SHA-256 of the documents file it
was rolled out from; the analysis reads the documents with :func:`read_documents_with_source`
and refuses a file that differs (:func:`check_rolled_out_from`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import polars as pl

from kvdiverge.io.parquet import read_verified_parquet, reading, write_parquet_with_metadata

__all__ = [
    "DOCUMENTS_SCHEMA",
    "DocumentsFormatError",
    "SOURCE_COLUMNS",
    "check_rolled_out_from",
    "read_documents",
    "read_documents_table",
    "read_documents_with_source",
    "write_documents",
]

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
    """Write a documents table atomically, with JSON key-value metadata, page checksums and
    the digests of :mod:`kvdiverge.io.parquet`."""
    table = frame.select(list(DOCUMENTS_SCHEMA)).cast(DOCUMENTS_SCHEMA)
    write_parquet_with_metadata(table, path, dict(metadata or {}))


WHAT = "documents file"


def read_documents_table(path: str | os.PathLike) -> pl.DataFrame:
    """A documents file's table as stored, verified (page checksums and, when it carries them,
    the digests it was written with: :func:`kvdiverge.io.parquet.read_verified_parquet`) but
    not checked against the contract (a rollout job's preflight checks it and names each
    document). A file written elsewhere without digests is accepted. Raises
    :class:`DocumentsFormatError` in one line naming the file."""
    return read_verified_parquet(path, WHAT, DocumentsFormatError, require=False)[0]


def read_documents(path: str | os.PathLike, columns: Sequence[str] | None = None) -> pl.DataFrame:
    """Read and check a documents table: all of :data:`DOCUMENTS_SCHEMA`'s columns, or only
    ``columns`` (``doc_id`` is always read), cast to the contract's types.

    Raises :class:`DocumentsFormatError` in one line naming the file when it is not a readable
    Parquet file, is damaged (:func:`read_documents_table`), lacks a wanted column, or repeats
    a ``doc_id``.
    """
    wanted = (
        list(DOCUMENTS_SCHEMA) if columns is None else list(dict.fromkeys(["doc_id", *columns]))
    )
    unknown = [c for c in wanted if c not in DOCUMENTS_SCHEMA]
    if unknown:
        raise ValueError(f"read_documents: no document column(s) {', '.join(unknown)}")
    stored = read_documents_table(path)  # verified first: a damaged file is called that
    missing = [c for c in wanted if c not in stored.columns]
    if missing:
        raise DocumentsFormatError(
            f"{path}: missing document column(s): the table lacks column(s) {', '.join(missing)}"
        )
    frame = stored.select(wanted)
    if frame["doc_id"].n_unique() != frame.height:
        raise DocumentsFormatError(f"{path}: doc_id values are not unique")
    return frame.cast({c: DOCUMENTS_SCHEMA[c] for c in wanted})


SOURCE_COLUMNS = ("documents_file", "documents_sha256")
"""The columns :func:`read_documents_with_source` adds: each document's file and that file's
SHA-256."""


def read_documents_with_source(
    path: str | os.PathLike, columns: Sequence[str] | None = None
) -> pl.DataFrame:
    """:func:`read_documents` with :data:`SOURCE_COLUMNS`: the file each document comes from
    and the file's SHA-256 (taken before the read), for :func:`check_rolled_out_from`."""
    from kvdiverge.io.files import sha256_file

    with reading(path, WHAT, DocumentsFormatError):
        digest = sha256_file(path)
    frame = read_documents(path, columns)
    return frame.with_columns(
        documents_file=pl.lit(str(path), dtype=pl.String),
        documents_sha256=pl.lit(digest, dtype=pl.String),
    )


def check_rolled_out_from(
    where: str | os.PathLike,
    metadata: Mapping[str, Any],
    doc_ids: Sequence[str] | pl.Series,
    documents: pl.DataFrame,
    error: type[Exception] = DocumentsFormatError,
) -> None:
    """Check that the rollout file ``where`` (trajectories or SWRB records, its ``metadata``,
    its ``doc_ids``) was rolled out from the documents files it is analysed with: the SHA-256
    its metadata ``documents`` records equals that of every file of ``documents``
    (:func:`read_documents_with_source`) that holds one of its documents. ``documents``
    without :data:`SOURCE_COLUMNS` (a table given in memory) is not checked. One ``error``
    naming both files, or saying that a file recording no digest must be rolled out again."""
    if not set(SOURCE_COLUMNS) <= set(documents.columns):
        return
    ids = pl.DataFrame({"doc_id": list(doc_ids)}, schema={"doc_id": pl.String})
    sources = (
        documents.join(ids, on="doc_id", how="semi")
        .select(SOURCE_COLUMNS)
        .unique()
        .sort(SOURCE_COLUMNS)
    )
    if sources.height == 0:
        return
    record = metadata.get("documents")
    recorded = record.get("sha256") if isinstance(record, Mapping) else None
    if not isinstance(recorded, str):
        raise error(
            f"{where}: its metadata records no SHA-256 of the documents file it was rolled out "
            f"from (written by an older kvdiverge), so it cannot be matched to "
            f"{sources['documents_file'][0]}: rerun its rollout (remove the file and run again)"
        )
    for file, digest in sources.iter_rows():
        if digest != recorded:
            raise error(
                f"{where}: rolled out from a documents file with SHA-256 {recorded[:16]}, but "
                f"{file} has SHA-256 {digest[:16]}: the documents changed after the rollout; "
                f"rerun the rollout (remove {where}, or touch {file}, and run again)"
            )
