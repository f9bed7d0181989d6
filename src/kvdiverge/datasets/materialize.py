"""Materialize one stratum's documents and read/write the documents table.

The stratum's env (:mod:`kvdiverge.datasets.registry`) builds its documents. Order of work in
every env: plan (config only) -> load the stratum's sources (a missing file is an error naming
where the data come from) -> check that the sources hold enough items -> check that every
task's smallest prompt fits the budget -> only then fit and build every document.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow.parquet as pq

from kvdiverge import __version__
from kvdiverge.datasets.fitting import LengthFn
from kvdiverge.datasets.registry import environment
from kvdiverge.datasets.strata import DatasetsConfig, plan_documents
from kvdiverge.io import atomic_path

__all__ = [
    "DOCUMENTS_SCHEMA",
    "DocumentsFormatError",
    "materialize_stratum",
    "read_documents",
    "stratum_source_paths",
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


def materialize_stratum(
    cfg: DatasetsConfig,
    stratum_name: str,
    length_fn: LengthFn,
    progress: Callable[[], None] | None = None,
) -> pl.DataFrame:
    """All documents of one stratum as a documents table.

    ``length_fn`` gives a prompt's tokenized length under the length model's chat template;
    every prompt satisfies ``length_fn(prompt) + generation_reserve <= target_tokens``.
    Deterministic in the config. ``progress`` is called once per finished document.
    """
    stratum = cfg.stratum(stratum_name)
    slots = [s for s in plan_documents(cfg) if s.stratum.name == stratum.name]
    if not slots:
        return pl.DataFrame(schema=DOCUMENTS_SCHEMA)
    rows = environment(stratum.env).documents(slots, cfg, length_fn, progress or (lambda: None))
    return pl.DataFrame(rows, schema=DOCUMENTS_SCHEMA)


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


def read_documents(path: str | os.PathLike) -> pl.DataFrame:
    """Read and check a documents table; one-line error naming the file."""
    frame = pl.read_parquet(path)
    missing = [c for c in DOCUMENTS_SCHEMA if c not in frame.columns]
    if missing:
        raise DocumentsFormatError(f"{path}: missing document column(s) {', '.join(missing)}")
    if frame["doc_id"].n_unique() != frame.height:
        raise DocumentsFormatError(f"{path}: doc_id values are not unique")
    return frame.select(list(DOCUMENTS_SCHEMA)).cast(DOCUMENTS_SCHEMA)


def stratum_source_paths(cfg: DatasetsConfig, stratum_name: str) -> list[Path]:
    """The data files and folders one stratum reads (for Snakemake inputs), existing or not."""
    stratum = cfg.stratum(stratum_name)
    tasks = {s.task for s in plan_documents(cfg) if s.stratum.name == stratum.name}
    return environment(stratum.env).source_paths(cfg, stratum, tasks)
