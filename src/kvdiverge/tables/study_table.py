"""A study table: its measures and columns, the rendered cells, and how values and intervals
are formatted (units, decimals from the interval widths, the hidden share of an unbounded
ratio)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from kvdiverge.analysis.bootstrap import MIN_INTERVAL_DOCUMENTS
from kvdiverge.tables.inputs import StudyTableError

PERCENT, PP, STEPS, COUNT, TEXT = "percent", "pp", "steps", "count", "text"
HIDDEN = "—"
"""The cell of a share whose ΔR_SMC interval covers 0 (the share is unbounded there)."""
SHARE_NOTE = (
    "— : share not shown, as the interval of ΔR_SMC covers 0 and the share is unbounded there "
    "(the CSV keeps its value and interval)."
)
NO_INTERVAL_NOTE = (
    "not available: an interval needs at least two documents and the row rests on fewer (a "
    "bootstrap of one document only repeats its value), so the value is shown alone."
)


def no_interval_text(n_docs: int) -> str:
    """The interval part of a cell whose row rests on fewer than two documents."""
    return f"[not available: {n_docs} document{'' if n_docs == 1 else 's'}]"


@dataclass(frozen=True)
class Measure:
    """One estimand shown as a column: its name, header label and unit of display."""

    estimand: str
    label: str
    unit: str = PERCENT


@dataclass(frozen=True)
class Column:
    """A rendered column: its label, display unit and interval level (``95% CI``; ``""`` for
    none or where the level is given per row)."""

    label: str
    unit: str = TEXT
    level: str = ""

    @property
    def title(self) -> str:
        """The label with its unit: ``R_SMC, %``."""
        return f"{self.label}{unit_suffix(self.unit)}"

    @property
    def header(self) -> str:
        """The one-line header of the Markdown rendering: ``R_SMC, % [95% CI]``."""
        return self.title + (f" [{self.level}]" if self.level else "")


class Cell(str):
    """A rendered cell: the string ``value [lo, hi]`` that also keeps its two parts, so that a
    rendering can set the interval on a line of its own."""

    value: str
    interval: str

    def __new__(cls, value: str, interval: str = "") -> Cell:
        cell = super().__new__(cls, f"{value} {interval}" if interval else value)
        cell.value, cell.interval = value, interval
        return cell


@dataclass(frozen=True)
class StudyTable:
    """A study table: ``data`` (the CSV, fractions) and its rendering (``header``, ``rows``).

    ``group_columns`` leading columns repeat a value only on its first row when rendered;
    ``columns`` describe every rendered column (label, unit, level); ``notes`` are printed
    under the table.
    """

    name: str
    caption: str
    data: pl.DataFrame
    header: list[str]
    rows: list[list[str]]
    group_columns: int = 1
    columns: tuple[Column, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def key_columns(self) -> int:
        """The leading text columns (group columns and the row label)."""
        return self.group_columns + 1

    def described_columns(self) -> tuple[Column, ...]:
        """``columns``, or text columns named by ``header`` when none were given."""
        if self.columns:
            return self.columns
        return tuple(Column(h) for h in self.header)


def _is_missing(x: float | None) -> bool:
    return x is None or not math.isfinite(x)


def _scale(unit: str) -> float:
    return 100.0 if unit in (PERCENT, PP) else 1.0


def decimals_for(half_widths: Sequence[float | None], unit: str, default: int = 1) -> int:
    """Decimals that match the intervals: the median half-width in the display unit rounded
    as the Particle Data Group rounds uncertainties — two significant digits when its leading
    digits are below 355, else one — so a half-width of 3.2 points shows one decimal, of 8.7
    or 12 none, of 0.21 two, of 0.4 one; between 0 and 3 decimals; ``default`` when no
    interval has a width."""
    shown = [abs(h) * _scale(unit) for h in half_widths if not _is_missing(h) and h != 0]
    if not shown:
        return default
    middle = float(np.median(shown))
    exponent = math.floor(math.log10(middle))
    digits = 2 if middle / 10**exponent < 3.55 else 1
    return min(3, max(0, digits - 1 - exponent))


def half_width(lo: float | None, hi: float | None) -> float | None:
    return None if _is_missing(lo) or _is_missing(hi) else (hi - lo) / 2


def format_value(x: float | None, unit: str, digits: int = 2) -> str:
    """A value for display (the estimands are fractions): ×100 for percent or percentage points,
    steps as they are, counts as integers; missing or non-finite → ``NA``. A value that rounds
    to zero shows no sign (never ``-0.0``)."""
    if _is_missing(x):
        return "NA"
    if unit == COUNT:
        return f"{int(round(x)):,}"
    text = f"{_scale(unit) * x:.{digits}f}"
    return text.lstrip("-") if float(text) == 0 else text


def format_interval(
    x: float | None, lo: float | None, hi: float | None, unit: str, digits: int = 2
) -> str:
    """``value [lo, hi]``, a bootstrap percentile interval, in the display unit (no interval
    part when both ends are missing)."""
    return str(interval_cell(x, lo, hi, unit, digits))


def interval_cell(
    x: float | None,
    lo: float | None,
    hi: float | None,
    unit: str,
    digits: int,
    n_docs: int | None = None,
) -> Cell:
    """``value [lo, hi]``; with ``n_docs`` below two, ``value [not available: n document]``
    (an undefined value is ``NA`` alone)."""
    value = format_value(x, unit, digits)
    if n_docs is not None and n_docs < MIN_INTERVAL_DOCUMENTS and not _is_missing(x):
        return Cell(value, no_interval_text(n_docs))
    if _is_missing(lo) and _is_missing(hi):
        return Cell(value)
    return Cell(value, f"[{format_value(lo, unit, digits)}, {format_value(hi, unit, digits)}]")


def level_text(levels: Sequence[float]) -> str:
    """``95% CI`` for one level; ``95%/99.375% CI`` when the rows of a column differ."""
    found = sorted({round(float(v), 10) for v in levels if not _is_missing(v)})
    if not found:
        return ""
    return "/".join(f"{100 * v:.10g}%" for v in found) + " CI"


def unit_suffix(unit: str) -> str:
    return {PERCENT: ", %", PP: ", pp", STEPS: ", steps"}.get(unit, "")


ZERO_TOLERANCE = 1e-12
"""An interval end within this of 0 counts as 0 (:func:`covers_zero`)."""


def covers_zero(lo: float, hi: float) -> bool:
    """Whether the finite interval [lo, hi] covers 0, an end within :data:`ZERO_TOLERANCE` of
    0 counting as 0.

    A bootstrap draw whose two actions agree gives a contrast of exactly 0 in exact arithmetic
    but ±1e-16 in floating point (the same terms summed in another order), so an end at
    -1.1e-16 is the rounding of 0, not an interval that excludes it. Every estimand here is a
    probability, a share or a step count, so 1e-12 is far below any difference a table shows.
    Missing (NaN) ends compare False: such an interval covers nothing.
    """
    return lo <= ZERO_TOLERANCE and -ZERO_TOLERANCE <= hi and lo <= hi


def _covers_zero(lo: float | None, hi: float | None) -> bool:
    """Whether an interval covers 0 (a missing end counts as covering)."""
    return _is_missing(lo) or _is_missing(hi) or covers_zero(lo, hi)


def estimand_row(
    table: pl.DataFrame,
    where: str,
    needed_by: str,
    measures: Sequence[Measure],
    *,
    model: str,
    action: str = "",
    contrast: str = "",
    stratum: str = "pooled",
) -> dict[str, float | None]:
    """``{estimand: value, estimand_low, estimand_high, estimand_level}`` for one table row."""
    rows = table.filter(
        (pl.col("model") == model)
        & (pl.col("action") == action)
        & (pl.col("contrast") == contrast)
        & (pl.col("stratum") == stratum)
        & pl.col("estimand").is_in([m.estimand for m in measures])
    )
    by_name = {r["estimand"]: r for r in rows.iter_rows(named=True)}
    unit = f"action {action!r}" if action else f"contrast {contrast!r}"
    out: dict[str, float | None] = {}
    for m in measures:
        r = by_name.get(m.estimand)
        if r is None:
            raise StudyTableError(
                f"{where}: estimand {m.estimand!r} missing for model {model!r}, {unit}, "
                f"stratum {stratum!r} (needed by {needed_by})"
            )
        out[m.estimand] = r["value"]
        out[f"{m.estimand}_low"] = r["ci_low"]
        out[f"{m.estimand}_high"] = r["ci_high"]
        out[f"{m.estimand}_level"] = r["ci_level"]
        out[f"{m.estimand}_docs"] = r["n_docs"]
    return out


def measure_table(
    name: str,
    caption: str,
    keys: Sequence[tuple[str, str]],
    records: Sequence[dict],
    measures: Sequence[Measure],
    shares: Sequence[str] = (),
) -> StudyTable:
    """Wide CSV (keys, then value/low/high/level per measure) and its rendering.

    Each measure's decimals follow its intervals (:func:`decimals_for`). ``shares`` name the
    measures that divide by ΔR_SMC (estimand ``R_smc`` of the same record): where that
    interval covers 0 they render as :data:`HIDDEN`, the CSV column ``share_shown`` says so and
    a note explains it. A measure whose row rests on fewer than two documents (its
    ``<estimand>_docs``) shows its value with the interval "not available", and a note says why.
    """
    records = [dict(r) for r in records]
    if shares:
        for rec in records:
            rec["share_shown"] = not _covers_zero(rec["R_smc_low"], rec["R_smc_high"])
    data = pl.DataFrame(records, infer_schema_length=None)
    columns = [Column(label) for _, label in keys]
    digits: dict[str, int] = {}
    for m in measures:
        if m.unit == COUNT:
            columns.append(Column(m.label, COUNT))
            continue
        columns.append(Column(m.label, m.unit, level_text(data[f"{m.estimand}_level"].to_list())))
        widths = [half_width(r[f"{m.estimand}_low"], r[f"{m.estimand}_high"]) for r in records]
        digits[m.estimand] = decimals_for(widths, m.unit)
    rows = []
    hidden = absent = False
    for rec in records:
        row: list[str] = [str(rec[k]) for k, _ in keys]
        for m in measures:
            if m.unit == COUNT:
                row.append(Cell(format_value(rec[m.estimand], COUNT)))
            elif m.estimand in shares and not rec["share_shown"]:
                row.append(Cell(HIDDEN))
                hidden = True
            else:
                v, lo, hi = (rec[m.estimand], rec[f"{m.estimand}_low"], rec[f"{m.estimand}_high"])
                n = rec.get(f"{m.estimand}_docs")
                row.append(interval_cell(v, lo, hi, m.unit, digits[m.estimand], n))
                absent |= n is not None and n < MIN_INTERVAL_DOCUMENTS
        rows.append(row)
    notes = ((SHARE_NOTE,) if hidden else ()) + ((NO_INTERVAL_NOTE,) if absent else ())
    header = [c.header for c in columns]
    return StudyTable(
        name, caption, data, header, rows, group_columns=1, columns=tuple(columns), notes=notes
    )
