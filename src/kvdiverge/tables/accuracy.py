"""Table A: task accuracy beside divergence, per model and action (docs/analysis.md,
"Task accuracy").

Namesakes by layer: :mod:`kvdiverge.analysis.accuracy` computes the accuracy estimands this
module formats; :mod:`kvdiverge.plots.accuracy` draws them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping, Sequence

import polars as pl

from kvdiverge.analysis.accuracy import ACCURACY_CAVEATS
from kvdiverge.tables.inputs import (
    actions_in,
    models_in,
    pooled_support,
    read_estimands,
    require_estimands,
)
from kvdiverge.tables.render import write_table
from kvdiverge.tables.study_table import PP, Measure, StudyTable, estimand_row, measure_table

ACCURACY_MEASURES = (
    Measure("accuracy_x", "full cache"),
    Measure("accuracy_y", "action"),
    Measure("accuracy_drop", "drop", PP),
    Measure("share@early", "early share"),
    Measure("accuracy_drop@early", "drop | early", PP),
    Measure("share@late", "late share"),
    Measure("accuracy_drop@late", "drop | late", PP),
)


def all_zero_or_undefined(values: Iterable[float | None]) -> bool:
    """Whether every value is 0, null or NaN (nothing to draw or compare: a model that answers
    nothing scores 0 under every cache)."""
    return all(v is None or not math.isfinite(v) or v == 0 for v in values)


def nothing_answered(table: pl.DataFrame, model: str, actions: Sequence[str] | None = None) -> bool:
    """Whether, in the long accuracy table, every pooled task accuracy of ``model`` — of the
    full cache (``accuracy_x``) and of each action's cache (``accuracy_y``), over ``actions``
    (default: all) — is 0 or undefined: no generation answers correctly, so every drop is 0 by
    construction and says nothing of eviction."""
    rows = table.filter(
        (pl.col("model") == model)
        & (pl.col("stratum") == "pooled")
        & pl.col("estimand").is_in(["accuracy_x", "accuracy_y"])
    )
    if actions is not None:
        rows = rows.filter(pl.col("action").is_in(list(actions)))
    return all_zero_or_undefined(rows["value"].to_list())


def nothing_answered_note(model: str) -> str:
    """The line that the accuracy table and figure show for a model of :func:`nothing_answered`."""
    return (
        f"{model}: no generation answers correctly (task accuracy 0% or undefined under the full "
        "cache and every action), so every drop is 0 by construction: nothing to compare, not "
        "evidence that eviction keeps accuracy."
    )


def accuracy_study_table(
    table: pl.DataFrame,
    actions: Sequence[str] | None = None,
    where: str = "accuracy",
    labels: Mapping[str, str] | None = None,
) -> StudyTable:
    """The accuracy table per model × action, pooled, from the long accuracy table
    (:func:`kvdiverge.analysis.accuracy.accuracy_table`): task accuracy of the full cache (X)
    and of the action (Y), the drop X − Y, and by divergence timing the share of paths that
    diverged early or late and the drop among them (paths that never diverge have equal X and
    Y, so no drop). Its notes state the two caveats of
    :data:`kvdiverge.analysis.accuracy.ACCURACY_CAVEATS`, after one line per model that answers
    nothing (:func:`nothing_answered`, :func:`nothing_answered_note`). The rendered rows show
    each action's label (``labels``, default its name); the CSV keeps the name."""
    needed = "the accuracy table"
    require_estimands(table, [m.estimand for m in ACCURACY_MEASURES], where, needed)
    actions = list(actions) if actions is not None else actions_in(table)
    records = []
    for model in models_in(table):
        for action in actions:
            rec = {"model": model, "action": action}
            rec |= estimand_row(table, where, needed, ACCURACY_MEASURES, model=model, action=action)
            rec["n_docs"], rec["n_paths"] = pooled_support(table, model, action, "accuracy_x")
            records.append(rec)
    caption = (
        "Task accuracy per model and action (all strata pooled), each generation scored with "
        "its source's metric: the full cache (X) and the action's cache (Y) on the same "
        "coupled paths, the drop X − Y (percentage points; paired document-bootstrap "
        "intervals), and by divergence timing the share of paths that diverged early "
        "(τ ≤ H/2) or late (H/2 < τ ≤ H) with the drop among them. Paths that never diverge "
        "within H generate the same text under both caches."
    )
    built = measure_table(
        "tableA",
        caption,
        [("model", "Model"), ("action", "Action")],
        records,
        ACCURACY_MEASURES,
    )
    empty = tuple(
        nothing_answered_note(m) for m in models_in(table) if nothing_answered(table, m, actions)
    )
    rows = [[r[0], str((labels or {}).get(r[1], r[1])), *r[2:]] for r in built.rows]
    return dataclasses.replace(built, rows=rows, notes=(*empty, *built.notes, *ACCURACY_CAVEATS))


def write_accuracy_table(
    accuracy_csv: str | os.PathLike,
    outputs: Sequence[str | os.PathLike],
    actions: Sequence[str] | None = None,
    registration: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> StudyTable:
    """Read the long accuracy CSV and write its table as (CSV, Markdown, LaTeX, HTML);
    ``registration``: a note saying which registration of the study's lock it comes from."""
    table = read_estimands(accuracy_csv)
    built = accuracy_study_table(table, actions, str(accuracy_csv), labels)
    if registration:
        built = dataclasses.replace(built, notes=(*built.notes, registration))
    write_table(built, *outputs)
    return built
