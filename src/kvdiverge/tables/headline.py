"""The headline table: each action's divergence and task accuracy side by side, and what the
number of documents allows.

One row per (model, action), pooled over strata: P(τ ≤ H), the mean entry time E[τ | τ ≤ H]
and R_SMC (from the estimands table), the task accuracy of the full cache's generations X and
of the action's Y (from the accuracy table), each with its document-bootstrap interval, and the
documents it rests on. ``summary.md`` of ``kvdiverge compare`` opens with it, and the report's
landing page opens with each study's (:func:`render_headline_rst`). :func:`accuracy_resolution`
says in one sentence when accuracy cannot tell the actions apart with so few documents.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import polars as pl

from kvdiverge.tables.study_table import covers_zero

__all__ = [
    "HEADLINE_COLUMNS",
    "accuracy_resolution",
    "headline_table",
    "render_headline_markdown",
    "render_headline_rst",
]

HEADLINE_COLUMNS = {
    "div_prob": ("P(τ ≤ H)", 100.0, "%"),
    "mean_entry_time": ("E[τ | τ ≤ H]", 1.0, "steps"),
    "R_smc": ("R_SMC", 100.0, "%"),
    "accuracy_x": ("accuracy, full cache (X)", 100.0, "%"),
    "accuracy_y": ("accuracy, action (Y)", 100.0, "%"),
}
"""The headline's columns: estimand → (heading, scale, unit)."""
_KEEP = ("model", "action", "estimand", "value", "ci_low", "ci_high", "ci_level", "n_docs")


def headline_table(
    estimands: pl.DataFrame, accuracy: pl.DataFrame | None, actions: Sequence[str]
) -> pl.DataFrame:
    """The pooled rows of :data:`HEADLINE_COLUMNS` of each of ``actions`` (every model),
    ``estimands``' and ``accuracy``'s own values and intervals, in the order of ``actions``."""
    parts = []
    for frame in (estimands, accuracy):
        if frame is None:
            continue
        rows = frame.filter(
            (pl.col("stratum") == "pooled")
            & (pl.col("contrast").fill_null("") == "")
            & pl.col("action").is_in(list(actions))
            & pl.col("estimand").is_in(list(HEADLINE_COLUMNS))
        )
        parts.append(rows.select(_KEEP).cast({"n_docs": pl.Int64}))
    table = pl.concat(parts, how="vertical_relaxed")
    rank = {a: i for i, a in enumerate(actions)}
    order = {e: i for i, e in enumerate(HEADLINE_COLUMNS)}
    return (
        table.with_columns(
            _a=pl.col("action").replace_strict(rank, return_dtype=pl.Int64),
            _e=pl.col("estimand").replace_strict(order, return_dtype=pl.Int64),
        )
        .sort("model", "_a", "_e", maintain_order=True)
        .drop("_a", "_e")
    )


def _number(x: float, digits: int) -> str:
    text = f"{x:.{digits}f}"
    return text.lstrip("-") if float(text) == 0 else text


def _cell(row: Mapping | None, scale: float) -> str:
    """``value [low, high]`` at one decimal (scaled), "undefined" for a non-finite value."""
    if row is None:
        return "—"
    v = row["value"]
    if v is None or not math.isfinite(v):
        return "undefined"
    text = _number(scale * v, 1)
    lo, hi = row["ci_low"], row["ci_high"]
    if lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi):
        text += f" [{_number(scale * lo, 1)}, {_number(scale * hi, 1)}]"
    return text


def _rows(
    table: pl.DataFrame, labels: Mapping[str, str] | None
) -> list[tuple[str, list[str], int]]:
    """(model, cells per action, documents) per model."""
    out = []
    for (model,), own in table.group_by(["model"], maintain_order=True):
        cells = []
        for (action,), rows in own.group_by(["action"], maintain_order=True):
            by = {r["estimand"]: r for r in rows.iter_rows(named=True)}
            name = (labels or {}).get(action, action)
            cells.append(
                [name, *(_cell(by.get(e), s) for e, (_, s, _) in HEADLINE_COLUMNS.items())]
            )
        n_docs = int(own["n_docs"].max()) if own.height else 0
        out.append((str(model), cells, n_docs))
    return out


def _heading(estimand: str) -> str:
    title, _, unit = HEADLINE_COLUMNS[estimand]
    return f"{title}, {unit}"


def render_headline_markdown(table: pl.DataFrame, labels: Mapping[str, str] | None = None) -> str:
    """The headline as Markdown, one table per model (``labels``: how actions are shown)."""
    level = next((float(v) for v in table["ci_level"].to_list() if v is not None), 0.95)
    lines = []
    for model, cells, n_docs in _rows(table, labels):
        head = ["action", *(_heading(e) for e in HEADLINE_COLUMNS)]
        lines += [
            f"**{model}**, {n_docs} documents; brackets: {100 * level:g}% document-bootstrap "
            "intervals.",
            "",
            "| " + " | ".join(h.replace("|", "\\|") for h in head) + " |",
            "|---|" + "---:|" * (len(head) - 1),
            *("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells),
            "",
        ]
    return "\n".join(lines)


def _rst(text: str) -> str:
    import re

    return re.sub(r"([\\`*_|])", r"\\\1", text)


def render_headline_rst(
    table: pl.DataFrame, labels: Mapping[str, str] | None = None, title: str = ""
) -> str:
    """The headline as reStructuredText list tables (the report's landing page), one per
    model, titled ``title`` and the model."""
    level = next((float(v) for v in table["ci_level"].to_list() if v is not None), 0.95)
    out = []
    for model, cells, n_docs in _rows(table, labels):
        head = ["action", *(_heading(e) for e in HEADLINE_COLUMNS)]
        caption = (
            f"{title + ', ' if title else ''}{model}: {n_docs} documents, pooled; brackets: "
            f"{100 * level:g}% document-bootstrap intervals"
        )
        out += [f".. list-table:: {_rst(caption)}", "   :header-rows: 1", ""]
        for row in [head, *cells]:
            out.append(f"   * - {_rst(row[0])}")
            out += [f"     - {_rst(c)}" for c in row[1:]]
        out.append("")
    return "\n".join(out)


def accuracy_resolution(contrasts: pl.DataFrame | None, n_docs: int) -> str | None:
    """One sentence when task accuracy cannot separate the actions: every Δ accuracy interval
    of ``contrasts`` (estimand ``accuracy``) includes 0, or there are no intervals. With n
    documents one document moves an action's accuracy by 100/n points. None when some
    Δ accuracy interval excludes 0, or there are no accuracy contrasts."""
    if contrasts is None or contrasts.height == 0:
        return None
    acc = contrasts.filter(pl.col("estimand") == "accuracy")
    if acc.height == 0 or _excludes_zero(acc):
        return None
    step = 100 / n_docs if n_docs else float("nan")
    timing = contrasts.filter(pl.col("estimand").is_in(["div_prob", "R_smc"]))
    tail = (
        "; P(τ ≤ H) or R_SMC does for some of them (an interval of their difference excludes 0)"
        if _excludes_zero(timing)
        else ""
    )
    return (
        f"Task accuracy cannot separate these actions with {n_docs} documents: every interval "
        f"of a difference in accuracy includes 0 (one document moves an action's accuracy by "
        f"{step:.0f} points){tail}."
    )


def _excludes_zero(rows: pl.DataFrame) -> bool:
    """Whether some row's interval is finite and excludes 0."""
    for r in rows.iter_rows(named=True):
        lo, hi = r["ci_low"], r["ci_high"]
        if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
            continue
        if not covers_zero(lo, hi):
            return True
    return False
