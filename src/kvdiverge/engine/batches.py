"""Several documents per model call: each call holds the rows of several documents, each with
its own prompt groups, positions and common random numbers (``docs/architecture.md``,
"Coupled decoding")."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvdiverge.engine.batch_plan import _Piece, plan_batches
from kvdiverge.engine.document import DocumentRollout, checked_actions
from kvdiverge.engine.memory import keep_freed_memory
from kvdiverge.engine.rows import _running_row_steps, _Unit, rollout_units
from kvdiverge.engine.settings import (
    ActionPaths,
    RolloutSettings,
    _clock,
    _is_oom,
    model_device,
)
from kvdiverge.eviction import (
    ActionSpec,
)

__all__ = [
    "plan_batches",
    "batched_paths",
]

log = logging.getLogger(__name__)


def _unit_row_steps(arrays: Sequence[Mapping[str, np.ndarray]], unit: _Unit) -> int:
    """Running row-steps of a unit: its X rows' once, each evicting intervention's own."""
    own = [
        _running_row_steps(a)[1]
        for a, act in zip(arrays, unit.interventions, strict=True)
        if act.evicting
    ]
    return _running_row_steps(arrays[0])[0] + sum(own)


def _halves(pieces: list[_Piece]) -> list[list[_Piece]]:
    """A batch cut in two: its pieces in halves, or one piece's replicates in halves."""
    if len(pieces) > 1:
        half = len(pieces) // 2
        return [pieces[:half], pieces[half:]]
    (p,) = pieces
    half = len(p.replicates) // 2
    per = p.rows // len(p.replicates)
    return [
        [_Piece(p.doc, p.group, reps, per * len(reps))]
        for reps in (p.replicates[:half], p.replicates[half:])
    ]


def batched_paths(
    model: torch.nn.Module,
    documents: Sequence[tuple[Any, ...]],
    actions: Sequence[ActionSpec | Mapping[str, Any]],
    eos_ids: Sequence[int],
    settings: RolloutSettings,
    skip: Any = None,
    on_step: Callable[[int, int, int, int], None] | None = None,
) -> Iterator[tuple[str, dict[str, ActionPaths]]]:
    """Coupled rollouts of many documents, the rows of several documents in each model call.

    ``documents``: ``(doc_id, input_ids, replicates)``; ``replicates`` as in
    :func:`paths_under_actions`, or a mapping that names only the actions the document
    runs; a fourth element, the document's :class:`kvdiverge.eviction.Prefill` for these
    actions, saves its prefill (benchmarks). Every argument is checked before any model call.
    The documents' reference groups are packed in order into batches of at most
    ``settings.max_batch_rows`` rows (:func:`plan_batches`; every member of a group counted as
    evicting); each batch decodes as one model call per step, each document with its own
    prompt groups, positions and common random numbers (:func:`rollout_units`). A document
    is prefilled (once, for all its actions) when its first batch runs and released after its
    last. Yields ``(doc_id, {action name: ActionPaths})`` in document order as each
    document's batches finish.

    A document's results equal its :func:`paths_under_actions` run to floating-point
    rounding (the matrix products' batch differs; the tokens differ only where a uniform falls
    within rounding of a CDF boundary), and a rerun is bit-identical. ``skip(doc_id)`` true:
    the document is not yielded, and a batch all of whose documents are skipped does not run
    (a resumed job); a batch that holds other documents runs whole, so that every document's
    bits equal an uninterrupted run's. On out-of-memory a batch is cut in halves (pieces, or a
    piece's replicates) and the budget of later batches drops to the size that fitted.

    Seconds (as in :func:`paths_under_actions`): a batch's decode seconds are shared by
    its units in proportion to their running row-steps; ``document_seconds`` of each result is
    the document's prefill, selections and share of the decode.

    ``on_step(batch, batches, t, H)``, when given, is called after decode step t of planned
    batch ``batch`` (0-based) of ``batches`` (a progress display: a batch cut in halves after
    an out-of-memory reports its steps again from 1).
    """
    specs = checked_actions(actions, eos_ids)
    keep_freed_memory()  # reuse the calls' multi-megabyte buffers (engine.memory)
    docs = [
        DocumentRollout.plan(doc_id, ids, specs, reps, settings.coupling, subset=True)
        for doc_id, ids, reps, *_ in documents
    ]
    given = {doc[0]: doc[3] for doc in documents if len(doc) > 3}  # prefills passed in
    seen = [d.doc_id for d in docs]
    if len(set(seen)) != len(seen):
        raise ValueError("documents: doc_id values are not unique")
    skip = skip or (lambda doc_id: False)
    plan = plan_batches(
        [[d.rows_per_replicate(g) for g in range(len(d.groups))] for d in docs],
        [[reps for _, reps, _ in d.groups] for d in docs],
        settings.max_batch_rows,
    )
    last_batch = {piece.doc: b for b, batch in enumerate(plan) for piece in batch}
    parts = [[[] for _ in doc.groups] for doc in docs]  # per document and group: chunk arrays
    seconds = [[0.0] * len(doc.groups) for doc in docs]
    budget = [settings.max_batch_rows]  # lowered after an out-of-memory split
    next_doc = 0  # documents are yielded in order, once their last batch has run
    for b, batch in enumerate(plan):
        indices = sorted({piece.doc for piece in batch})
        if not all(skip(docs[d].doc_id) for d in indices):
            for d in indices:
                if docs[d].prefill is None:
                    docs[d].prepare(model, settings, given.get(docs[d].doc_id))
            hook = None if on_step is None else _batch_hook(on_step, b, len(plan), settings.H)
            ran = _run_batch(model, docs, batch, eos_ids, settings, budget, hook)
            for pieces, arrays, share in ran:
                for piece, piece_arrays, piece_seconds in zip(pieces, arrays, share, strict=True):
                    parts[piece.doc][piece.group].append(piece_arrays)
                    seconds[piece.doc][piece.group] += piece_seconds
        while next_doc < len(docs) and last_batch.get(next_doc, b) <= b:
            doc = docs[next_doc]
            if not skip(doc.doc_id) and doc.groups:
                out = doc.results(parts[next_doc], seconds[next_doc])
                assert doc.selection_seconds is not None
                own = doc.prefill_seconds + sum(doc.selection_seconds.values())
                for result in out.values():
                    result.document_seconds = own + sum(seconds[next_doc])
                yield doc.doc_id, out
            doc.release()
            parts[next_doc] = []
            next_doc += 1


def _batch_hook(
    on_step: Callable[[int, int, int, int], None], batch: int, batches: int, H: int
) -> Callable[[int], None]:
    """``on_step`` of :func:`batched_paths` bound to one planned batch."""
    return lambda t: on_step(batch, batches, t, H)


def _run_batch(
    model: torch.nn.Module,
    docs: Sequence[DocumentRollout],
    batch: list[_Piece],
    eos_ids: Sequence[int],
    settings: RolloutSettings,
    budget: list[int],
    on_step: Callable[[int], None] | None = None,
) -> Iterator[tuple[list[_Piece], list[list[dict[str, np.ndarray]]], list[float]]]:
    """Decode one planned batch: yields (pieces, their arrays, their decode seconds) per model
    batch that ran. A batch above ``budget[0]`` rows (lowered by an earlier out-of-memory) is
    cut in halves first; on out-of-memory it is cut in halves and ``budget[0]`` lowered. A
    batch's seconds are shared by its units in proportion to their running row-steps."""
    device = model_device(model)
    pending = [batch]
    while pending:
        pieces = pending.pop(0)
        rows = sum(p.rows for p in pieces)
        splittable = len(pieces) > 1 or len(pieces[0].replicates) > 1
        if rows > budget[0] and splittable:
            pending[:0] = _halves(pieces)
            continue
        units = [docs[p.doc].unit(p.group, p.replicates) for p in pieces]
        start = _clock(device)
        try:
            arrays = rollout_units(model, units, eos_ids, settings, on_step)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not _is_oom(exc) or not splittable:
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            budget[0] = min(budget[0], rows // 2)
            log.warning("out of memory with %d batch rows; splitting into halves", rows)
            pending[:0] = _halves(pieces)
            continue
        batch_seconds = _clock(device) - start
        steps = [_unit_row_steps(a, unit) for a, unit in zip(arrays, units, strict=True)]
        total = max(sum(steps), 1)
        yield pieces, arrays, [batch_seconds * s / total for s in steps]
