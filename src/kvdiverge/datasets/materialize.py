"""Materialize one stratum's documents and read/write the documents table.

Order of work: plan (config only) -> load the stratum's sources (a missing file is an error
naming where the data come from) -> check that the sources hold enough questions -> check that
every task's smallest prompt fits the budget -> only then fit and build every document.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow.parquet as pq

from kvdiverge import __version__
from kvdiverge.datasets import ruler as R
from kvdiverge.datasets.fitting import (
    DatasetError,
    LengthFitError,
    LengthFn,
    derive_seed,
    ruler_unit_search,
)
from kvdiverge.datasets.helmet import (
    HELMET_TASK_NAMES,
    HelmetSource,
    build_helmet_prompt,
    helmet_file_paths,
    load_helmet_source,
)
from kvdiverge.datasets.strata import DatasetsConfig, DocumentSlot, Stratum, plan_documents
from kvdiverge.io import atomic_path

__all__ = [
    "DOCUMENTS_SCHEMA",
    "DocumentsFormatError",
    "materialize_stratum",
    "read_documents",
    "stratum_source_paths",
    "write_documents",
]

log = logging.getLogger(__name__)

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

_MAX_REDRAWS = 100


class DocumentsFormatError(ValueError):
    """A documents file does not follow `docs/architecture.md`, "File contracts"."""


def _search_ruler_units(
    task: str,
    stratum: Stratum,
    cfg: DatasetsConfig,
    length_fn: LengthFn,
    build: Callable[[int, random.Random], R.RulerSample],
    min_units: int,
    qa_docs: tuple[str, ...] | None = None,
) -> int:
    budget = stratum.target_tokens - cfg.generation_reserve
    search_seed = derive_seed(cfg.seed, stratum.name, task, "search")
    probes = iter(range(10**9))

    def n_tokens(units: int) -> int:
        rng = random.Random(derive_seed(search_seed, next(probes)))
        return length_fn(build(units, rng).prompt)

    if task == "fwe":  # RULER's linear search
        step = max(1, budget // 32)
        n = max(min_units, budget // 6)
        if n_tokens(n) <= budget:
            while n_tokens(n + step) <= budget:
                n += step
        else:
            while n > min_units and n_tokens(n) > budget:
                n = max(min_units, n - step)
        units: int | None = n
    else:
        inc = R.unit_increment(task, stratum.target_tokens)
        max_units = len(qa_docs) if qa_docs is not None else None
        units = ruler_unit_search(n_tokens, budget, min_units, inc, max_units=max_units)
    if units is None:
        needed = length_fn(build(min_units, random.Random(0)).prompt)
        raise LengthFitError(_no_fit(stratum, task, needed, cfg))
    return units


def _no_fit(stratum: Stratum, task: str, needed: int, cfg: DatasetsConfig) -> str:
    budget = stratum.target_tokens - cfg.generation_reserve
    return (
        f"{stratum.name} {task}: the shortest prompt needs {needed} tokens under "
        f"{cfg.length_tokenizer or 'the length tokenizer'}, over the budget of {budget} "
        f"(target_tokens {stratum.target_tokens} - generation_reserve {cfg.generation_reserve})"
    )


def _ruler_documents(
    slots: list[DocumentSlot], cfg: DatasetsConfig, length_fn: LengthFn, progress: Callable
) -> list[dict[str, Any]]:
    stratum = slots[0].stratum
    budget = stratum.target_tokens - cfg.generation_reserve
    tasks = list(dict.fromkeys(s.task for s in slots))
    # sources first: a missing file fails before any tokenization
    essays = None
    if any(R.task_needs_essays(t) for t in tasks):
        essays = R.load_essays(cfg.essay_dir) if cfg.essay_dir else R.synthetic_essays(cfg.seed)
    qa = {}
    if "qa_1" in tasks:
        qa["qa_1"] = R.load_squad(cfg.squad)
    if "qa_2" in tasks:
        qa["qa_2"] = R.load_hotpotqa(cfg.hotpotqa)
    for task, src in qa.items():
        needed = max(s.source_index for s in slots if s.task == task) + 1
        if needed > len(src.questions):
            raise DatasetError(
                f"{stratum.name} {task}: the plan needs {needed} distinct questions but "
                f"{src.source} holds {len(src.questions)}; lower datasets.cohorts"
            )
    vocab_seed = derive_seed(cfg.seed, "cwe-vocabulary")

    def builder(task: str, question_index: int, example_units: int):
        def build(units: int, rng: random.Random) -> R.RulerSample:
            return R.build_ruler_prompt(
                task,
                units,
                rng,
                target_tokens=stratum.target_tokens,
                budget=budget,
                vocab_seed=vocab_seed,
                essays=essays,
                qa=qa.get(task),
                question_index=question_index,
                example_units=example_units,
            )

        return build

    # vt's one-shot example: plain template fitted to min(500, budget // 4) tokens (RULER)
    vt_example_units = 1
    if "vt" in tasks:
        ex_budget = min(500, budget // 4)
        ex_rng = derive_seed(cfg.seed, stratum.name, "vt-example")
        for units in range(1, 200):
            if length_fn(R.vt_example_text(units + 1, random.Random(ex_rng))) > ex_budget:
                break
            vt_example_units = units + 1
    # feasibility of every task before the searches
    minimum: dict[tuple[str, int], int] = {}
    for slot in slots:
        q = qa[slot.task].questions[slot.source_index] if slot.task in qa else None
        m = R.min_units(slot.task, q)
        minimum[(slot.task, slot.source_index)] = m
        qi = slot.source_index if q else 0
        needed = length_fn(builder(slot.task, qi, vt_example_units)(m, random.Random(0)).prompt)
        if needed > budget:
            raise LengthFitError(_no_fit(stratum, slot.task, needed, cfg))
    units_by_task = {}
    for task in tasks:
        first = next(s for s in slots if s.task == task)
        qi = first.source_index if task in qa else 0
        build = builder(task, qi, vt_example_units)
        units_by_task[task] = _search_ruler_units(
            task,
            stratum,
            cfg,
            length_fn,
            build,
            minimum[(task, first.source_index)],
            qa[task].documents if task in qa else None,
        )
        log.info("%s %s: %d units", stratum.name, task, units_by_task[task])
    used: set[str] = set()
    rows = []
    for slot in slots:
        qi = slot.source_index if slot.task in qa else 0
        build = builder(slot.task, qi, vt_example_units)
        lo = minimum[(slot.task, slot.source_index)]
        step = 1 if slot.task == "fwe" else R.unit_increment(slot.task, stratum.target_tokens)
        for attempt in range(_MAX_REDRAWS):
            seed = slot.seed if attempt == 0 else derive_seed(slot.seed, attempt)
            units = max(lo, units_by_task[slot.task])
            while True:
                sample = build(units, random.Random(seed))
                n = length_fn(sample.prompt)
                if n <= budget:
                    break
                if units == lo:
                    raise LengthFitError(_no_fit(stratum, slot.task, n, cfg))
                units = max(lo, units - step)
            if not sample.items & used:
                break
        else:
            raise DatasetError(f"{slot.doc_id}: no needle set disjoint from the other documents")
        used |= sample.items
        if slot.task in qa:
            source = qa[slot.task].source
        elif R.task_needs_essays(slot.task):
            source = essays.source
        else:
            source = "generated"
        rows.append(
            _row(slot, sample.prompt, sample.answers, f"ruler:{slot.task} {source}", seed, n)
        )
        progress()
    return rows


def _helmet_documents(
    slots: list[DocumentSlot], cfg: DatasetsConfig, length_fn: LengthFn, progress: Callable
) -> list[dict[str, Any]]:
    stratum = slots[0].stratum
    budget = stratum.target_tokens - cfg.generation_reserve
    tasks = list(dict.fromkeys(s.task for s in slots))
    sources: dict[str, HelmetSource] = {}
    for dataset in tasks:
        count = stratum.cite_documents if dataset.startswith("alce") else stratum.rag_passages
        sources[dataset] = load_helmet_source(
            dataset,
            cfg.helmet_data_dir,
            cfg.helmet_prompts_dir,
            count,
            derive_seed(cfg.seed, dataset, "keys"),
            cfg.popqa_max_log10_pop,
        )
        needed = max(s.source_index for s in slots if s.task == dataset) + 1
        held = len(sources[dataset].key_order)
        if needed > held:
            raise DatasetError(
                f"{stratum.name} {dataset}: the plan needs {needed} distinct questions but "
                f"{sources[dataset].source} holds {held}; lower datasets.cohorts"
            )
    rows = []
    for slot in slots:
        src = sources[slot.task]
        count = stratum.cite_documents if slot.task.startswith("alce") else stratum.rag_passages
        try:
            built = build_helmet_prompt(
                src,
                src.key_order[slot.source_index],
                count,
                random.Random(slot.seed),
                length_fn,
                budget,
                cfg.helmet_shots,
            )
        except LengthFitError as exc:
            raise LengthFitError(f"{stratum.name} {slot.task}: {exc}") from None
        n = length_fn(built.prompt)
        source = f"helmet:{slot.task} {src.source} context_kept={built.context_kept:.3f}"
        rows.append(
            _row(slot, built.prompt, built.answers, source, slot.seed, n, HELMET_TASK_NAMES)
        )
        progress()
    return rows


def _row(slot, prompt, answers, source, seed, n, names: Mapping[str, str] | None = None) -> dict:
    return {
        "doc_id": slot.doc_id,
        "stratum": slot.stratum.name,
        "env": slot.stratum.env,
        "length_label": slot.stratum.label,
        "target_tokens": slot.stratum.target_tokens,
        "task": names[slot.task] if names else slot.task,
        "cohort": slot.cohort,
        "prompt": prompt,
        "answers": list(answers),
        "source": source,
        "seed": seed,
        "n_tokens": n,
    }


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
    tick = progress or (lambda: None)
    if stratum.env == "ruler":
        rows = _ruler_documents(slots, cfg, length_fn, tick)
    else:
        rows = _helmet_documents(slots, cfg, length_fn, tick)
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
    paths: list[Path] = []
    if stratum.env == "ruler":
        if cfg.essay_dir and any(R.task_needs_essays(t) for t in tasks):
            paths += sorted(Path(cfg.essay_dir).glob("*.txt")) or [Path(cfg.essay_dir)]
        paths += [cfg.squad] if "qa_1" in tasks else []
        paths += [cfg.hotpotqa] if "qa_2" in tasks else []
        return paths
    for dataset in sorted(tasks):
        count = stratum.cite_documents if dataset.startswith("alce") else stratum.rag_passages
        paths += list(
            helmet_file_paths(dataset, cfg.helmet_data_dir, cfg.helmet_prompts_dir, count)
        )
    return list(dict.fromkeys(paths))
