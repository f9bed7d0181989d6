"""Materialize one stratum's documents (the table's contract: :mod:`kvdiverge.io.documents`).

The stratum's env (:mod:`kvdiverge.datasets.registry`) builds its documents. Order of work in
every env: plan (config only) -> load the stratum's sources (a missing file is an error naming
where the data come from) -> check that the sources hold enough items -> check that every
task's smallest prompt fits the budget -> only then fit and build every document.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import polars as pl

from kvdiverge.datasets.fitting import LengthFn
from kvdiverge.datasets.registry import environment
from kvdiverge.datasets.strata import DatasetsConfig, plan_documents
from kvdiverge.io.documents import DOCUMENTS_SCHEMA

__all__ = ["materialize_stratum", "stratum_source_paths"]


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


def stratum_source_paths(cfg: DatasetsConfig, stratum_name: str) -> list[Path]:
    """The data files and folders one stratum reads (for Snakemake inputs), existing or not."""
    stratum = cfg.stratum(stratum_name)
    tasks = {s.task for s in plan_documents(cfg) if s.stratum.name == stratum.name}
    return environment(stratum.env).source_paths(cfg, stratum, tasks)
