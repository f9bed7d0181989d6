"""The ``helmet`` dataset environment: HELMET's RAG (KILT) and Cite (ALCE) datasets.

Prompts come from :mod:`kvdiverge.datasets.helmet` (the file readers and templates): K passages
(RAG) or N documents (Cite) per question at the stratum's length, the context cut from its end
to the budget as HELMET truncates. A stratum takes ``rag_passages`` and ``cite_documents``,
defaulting to HELMET's table at its standard lengths. Scored as HELMET scores: substring exact
match for the KILT datasets, ``str_em`` for ASQA and top-5 recall for QAMPARI
(:mod:`kvdiverge.datasets.scoring`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvdiverge.datasets.fitting import DatasetError, LengthFitError, LengthFn, derive_seed
from kvdiverge.datasets.helmet import (
    CITE_DOCUMENTS,
    HELMET_TASK_NAMES,
    RAG_PASSAGES,
    HelmetSource,
    build_helmet_prompt,
    helmet_file_paths,
    load_helmet_source,
)
from kvdiverge.datasets.registry import DatasetEnvironment, document_row, register_environment

if TYPE_CHECKING:
    from kvdiverge.datasets.strata import DatasetsConfig, DocumentSlot, Stratum

__all__ = ["HelmetEnvironment"]

_METRICS = {"asqa": "str_em", "qampari": "qampari_rec_top5"}


@register_environment
class HelmetEnvironment(DatasetEnvironment):
    """HELMET's RAG and Cite datasets (``datasets.helmet``)."""

    name = "helmet"
    stratum_keys = ("rag_passages", "cite_documents")

    def stratum_options(self, spec: Mapping[str, Any], target: int, where: str) -> dict[str, Any]:
        """``rag_passages`` and ``cite_documents``, by default HELMET's at standard lengths."""
        super().stratum_options(spec, target, where)
        rag, cite = spec.get("rag_passages"), spec.get("cite_documents")
        rag = rag if rag is not None else RAG_PASSAGES.get(target)
        cite = cite if cite is not None else CITE_DOCUMENTS.get(target)
        if rag is None or cite is None:
            raise DatasetError(
                f"{where}: HELMET at {target} tokens needs rag_passages and "
                f"cite_documents (HELMET defines them only for "
                f"{', '.join(map(str, sorted(RAG_PASSAGES)))})"
            )
        return {"rag_passages": int(rag), "cite_documents": int(cite)}

    def tasks(self, cfg: DatasetsConfig, stratum: Stratum) -> tuple[str, ...]:
        """``datasets.helmet.datasets``."""
        return cfg.helmet_datasets

    def documents(
        self,
        slots: list[DocumentSlot],
        cfg: DatasetsConfig,
        length_fn: LengthFn,
        progress: Callable[[], None],
    ) -> list[dict[str, Any]]:
        """Every dataset's files and question counts first, then one prompt per slot."""
        return _helmet_documents(slots, cfg, length_fn, progress)

    def source_paths(self, cfg: DatasetsConfig, stratum: Stratum, tasks: set[str]) -> list[Path]:
        """Each dataset's test and demo files at the stratum's K or N, and its prompt file."""
        paths: list[Path] = []
        for dataset in sorted(tasks):
            count = _count(stratum, dataset)
            paths += list(
                helmet_file_paths(dataset, cfg.helmet_data_dir, cfg.helmet_prompts_dir, count)
            )
        return list(dict.fromkeys(paths))

    def metric(self, stratum: Stratum, task: str) -> str:
        """HELMET's metric of the dataset (``task`` is its short name, e.g. ``nq``)."""
        return _METRICS.get(task, "substring_exact_match")


def _count(stratum: Stratum, dataset: str) -> int | None:
    return stratum.cite_documents if dataset.startswith("alce") else stratum.rag_passages


def _helmet_documents(
    slots: list[DocumentSlot], cfg: DatasetsConfig, length_fn: LengthFn, progress: Callable
) -> list[dict[str, Any]]:
    stratum = slots[0].stratum
    budget = stratum.target_tokens - cfg.generation_reserve
    tasks = list(dict.fromkeys(s.task for s in slots))
    sources: dict[str, HelmetSource] = {}
    for dataset in tasks:
        count = _count(stratum, dataset)
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
        count = _count(stratum, slot.task)
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
            document_row(
                slot,
                built.prompt,
                built.answers,
                source,
                slot.seed,
                n,
                HELMET_TASK_NAMES[slot.task],
            )
        )
        progress()
    return rows
