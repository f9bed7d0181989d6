"""The plan of a job's model calls, made before any model loads (numpy only, no torch): which
documents' reference groups share a call (:func:`plan_batches`), and the share of the prompt
from which an action's prompt attention runs masked rather than gathered
(:data:`MASKED_MIN_FRACTION`). The engine runs these plans (:mod:`kvdiverge.engine.batches`,
:mod:`kvdiverge.engine.document`); the memory plan and the roofline estimates read them
(:mod:`kvdiverge.engine.memory_plan`, :mod:`kvdiverge.engine.roofline`), at a Snakefile's parse
too."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MASKED_MIN_FRACTION", "plan_batches"]

MASKED_MIN_FRACTION = 0.25
"""``prompt_attention="auto"``: an action keeping at least this fraction of the prompt (mean over
layers and KV heads) joins its document's masked pass over the full prompt; one keeping less
attends to its gathered entries (measured: ``benchmarks/README.md``, "Prompt attention
layouts")."""


@dataclass(frozen=True)
class _Piece:
    """A planned part of a batch: document ``doc``'s reference group ``group``, replicates
    ``replicates`` (all of the group's, or a chunk), at most ``rows`` batch rows."""

    doc: int
    group: int
    replicates: np.ndarray
    rows: int


def plan_batches(
    rows_per_replicate: Sequence[Sequence[int]],
    replicates: Sequence[Sequence[Sequence[int]]],
    max_rows: int,
) -> list[list[_Piece]]:
    """Pack the documents' reference groups, in order, into batches of at most ``max_rows``
    rows.

    ``rows_per_replicate[d][g]`` and ``replicates[d][g]``: document d's group g. A group that
    alone exceeds ``max_rows`` is cut into chunks of ``max_rows // rows_per_replicate``
    replicates (at least one); pieces are added to the current batch while its rows fit,
    else a new batch starts. The plan depends only on these arguments, so a rerun (or a resumed
    job) runs the same batches.
    """
    batches: list[list[_Piece]] = [[]]
    used = 0
    for d, (per_group, reps_group) in enumerate(zip(rows_per_replicate, replicates, strict=True)):
        for g, (per, reps) in enumerate(zip(per_group, reps_group, strict=True)):
            reps = np.asarray(reps, dtype=np.int64)
            chunk = max(1, max_rows // per)
            for i in range(0, len(reps), chunk):
                part = reps[i : i + chunk]
                rows = per * len(part)
                if batches[-1] and used + rows > max_rows:
                    batches.append([])
                    used = 0
                batches[-1].append(_Piece(d, g, part, rows))
                used += rows
    return [batch for batch in batches if batch]
