"""The ``ruler`` dataset environment: RULER's 13 synthetic tasks, fitted to a stratum's length.

Prompts come from :mod:`kvdiverge.datasets.ruler` (the generators), sized by RULER's own unit
searches (binary search over haystack units; a linear search for ``fwe``) under the length
tokenizer; every needle set is disjoint from the other documents'. Scored as RULER scores:
``string_match_all`` (the fraction of gold strings found, case-insensitive), and
``string_match_part`` (any gold string found) for ``qa_1`` and ``qa_2``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvdiverge.datasets import ruler as R
from kvdiverge.datasets.fitting import (
    DatasetError,
    LengthFitError,
    LengthFn,
    derive_seed,
    describe_length,
    ruler_unit_search,
)
from kvdiverge.datasets.registry import DatasetEnvironment, document_row, register_environment

if TYPE_CHECKING:
    from kvdiverge.datasets.strata import DatasetsConfig, DocumentSlot, Stratum

__all__ = ["RulerEnvironment"]

log = logging.getLogger(__name__)

_MAX_REDRAWS = 100
_PART_TASKS = ("qa_1", "qa_2")


@register_environment
class RulerEnvironment(DatasetEnvironment):
    """RULER's synthetic tasks (``datasets.ruler``)."""

    name = "ruler"

    def tasks(self, cfg: DatasetsConfig, stratum: Stratum) -> tuple[str, ...]:
        """``datasets.ruler.tasks``."""
        return cfg.ruler_tasks

    def documents(
        self,
        slots: list[DocumentSlot],
        cfg: DatasetsConfig,
        length_fn: LengthFn,
        progress: Callable[[], None],
    ) -> list[dict[str, Any]]:
        """Sources first, then every task's feasibility, then the unit searches and documents."""
        return _ruler_documents(slots, cfg, length_fn, progress)

    def source_paths(self, cfg: DatasetsConfig, stratum: Stratum, tasks: set[str]) -> list[Path]:
        """The essay files (when a task needs essays), SQuAD for qa_1, HotpotQA for qa_2."""
        paths: list[Path] = []
        if cfg.essay_dir and any(R.task_needs_essays(t) for t in tasks):
            paths += sorted(Path(cfg.essay_dir).glob("*.txt")) or [Path(cfg.essay_dir)]
        paths += [cfg.squad] if "qa_1" in tasks else []
        paths += [cfg.hotpotqa] if "qa_2" in tasks else []
        return paths

    def metric(self, stratum: Stratum, task: str) -> str:
        """RULER's metric of the task."""
        return "string_match_part" if task in _PART_TASKS else "string_match_all"


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
        shortest = build(min_units, random.Random(0)).prompt
        raise LengthFitError(_no_fit(stratum, task, shortest, length_fn, cfg))
    return units


def _no_fit(
    stratum: Stratum, task: str, prompt: str, length_fn: LengthFn, cfg: DatasetsConfig
) -> str:
    budget = stratum.target_tokens - cfg.generation_reserve
    needed = describe_length(length_fn, prompt, cfg.length_tokenizer or "the length tokenizer")
    return (
        f"{stratum.name} {task}: the shortest prompt needs {needed}, over the budget of "
        f"{budget} (target_tokens {stratum.target_tokens} - generation_reserve "
        f"{cfg.generation_reserve})"
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
        shortest = builder(slot.task, qi, vt_example_units)(m, random.Random(0)).prompt
        if length_fn(shortest) > budget:
            raise LengthFitError(_no_fit(stratum, slot.task, shortest, length_fn, cfg))
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
                    raise LengthFitError(_no_fit(stratum, slot.task, sample.prompt, length_fn, cfg))
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
            document_row(
                slot, sample.prompt, sample.answers, f"ruler:{slot.task} {source}", seed, n
            )
        )
        progress()
    return rows
