"""Materialize one stratum's documents (the table's contract: :mod:`kvdiverge.io.documents`).

The stratum's env (:mod:`kvdiverge.datasets.registry`) builds its documents. Order of work in
every env: plan (config only) -> load the stratum's sources (a missing file is an error naming
where the data come from) -> check that the sources hold enough items -> check that every
task's smallest prompt fits the budget -> only then fit and build every document.

A study of several models (:func:`materialize_for_models`) fits every document under all of
their tokenizers at once (:class:`kvdiverge.datasets.fitting.LongestLength`), after checking
that each model's context window holds the stratum's length, and checks each finished document
under each model (:func:`kvdiverge.datasets.fitting.model_lengths`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import polars as pl

from kvdiverge.datasets.fitting import (
    LengthFn,
    LongestLength,
    ModelLength,
    check_model_windows,
    model_lengths,
)
from kvdiverge.datasets.registry import environment
from kvdiverge.datasets.strata import DatasetsConfig, plan_documents
from kvdiverge.io.documents import DOCUMENTS_SCHEMA

__all__ = ["materialize_for_models", "materialize_stratum", "stratum_source_paths"]


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


def materialize_for_models(
    cfg: DatasetsConfig,
    stratum_name: str,
    models: Sequence[ModelLength],
    progress: Callable[[], None] | None = None,
) -> tuple[pl.DataFrame, dict[str, dict[str, int]]]:
    """One stratum's documents fitted for every model of the study, and each model's length
    of each document (model → doc_id → n).

    Every model's window must hold ``target_tokens`` (checked first); the documents are fitted
    under the longest of the models' chat-wrapped lengths, so that ``n_m + generation_reserve
    <= target_tokens`` holds under each model's own tokenizer, and each finished document is
    checked under each model. The table's ``n_tokens`` is the length under
    ``datasets.length_tokenizer`` when it is one of the models, else the longest. Each failure
    is one :class:`~kvdiverge.datasets.fitting.LengthFitError` line naming the stratum or the
    document, the model and the lengths.
    """
    stratum = cfg.stratum(stratum_name)
    check_model_windows(models, stratum.name, stratum.target_tokens)
    lengths = LongestLength(models)
    frame = materialize_stratum(cfg, stratum_name, lengths, progress)
    found = model_lengths(
        frame["doc_id"].to_list(),
        frame["prompt"].to_list(),
        lengths,
        stratum.target_tokens,
        cfg.generation_reserve,
    )
    if cfg.length_tokenizer in found:
        n = pl.Series("n_tokens", found[cfg.length_tokenizer], dtype=pl.Int64)
        frame = frame.with_columns(n_tokens=n)
    ids = frame["doc_id"].to_list()
    return frame, {name: dict(zip(ids, ns, strict=True)) for name, ns in found.items()}


def stratum_source_paths(cfg: DatasetsConfig, stratum_name: str) -> list[Path]:
    """The data files and folders one stratum reads (for Snakemake inputs), existing or not."""
    stratum = cfg.stratum(stratum_name)
    tasks = {s.task for s in plan_documents(cfg) if s.stratum.name == stratum.name}
    return environment(stratum.env).source_paths(cfg, stratum, tasks)
