"""Tables 1–4 of the language-model study as CSV, Markdown, LaTeX and HTML, and the
estimands' tidy Parquet copy with a one-page summary.

Every table is built from the long estimands table (``estimands.csv``, written by
:func:`kvdiverge.analysis.estimands.write_estimands`) and, for Table 4, the prediction table
(``prediction.csv``); nothing is recomputed. The CSV keeps the values as fractions, exactly as
read; the rendered tables show fractions as percent (contrasts as percentage points), mean
entry times in steps and counts as integers, with intervals as ``[lo, hi]``. A column's
decimals follow its interval widths (:func:`decimals_for`), a value never shows as ``-0``, and a
share of ΔR_SMC shows "—" where the interval of ΔR_SMC covers 0 (:data:`SHARE_NOTE`).

* Table 1 — timing and occupation per model × action, pooled: R_SMC, O_H, E_H, C_H, Π_H,
  E[τ | τ ≤ H], S_.99 and the branch-cohort support (documents / paths).
* Table 2 — gap decomposition per model × contrast, pooled: ΔR_SMC and its occurrence,
  exposure and rate terms, with their shares of ΔR_SMC.
* Table 3 — the main contrast per model × stratum: ΔR_SMC, exposure term and share, the
  generation-clock change Δg, Δ(R − F), and each action's branch contrast B(a).
* Table 4 — uncalibrated contrasts for the main contrast per model: full-H rollout-TV gap,
  fixed-history gap, positions 1–prefix flat-extrapolation gap, full − fixed, full − flat
  (from the estimands), then the development-selected predictions of that contrast (error with
  its interval and equivalence decision, document-contrast MAE and RMSE) where
  ``prediction.csv`` holds them.

Renderings: Markdown (one wide table), LaTeX (a booktabs ``table*`` whose wide tables are split
into stacked panels, :func:`render_latex`) and a self-contained HTML page for the report
(:func:`render_html`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path

import numpy as np
import polars as pl

from kvdiverge.analysis.estimands import ESTIMAND_COLUMNS
from kvdiverge.analysis.prediction import PREDICTION_COLUMNS
from kvdiverge.io import atomic_path, atomic_write_text

__all__ = [
    "ESTIMAND_COLUMNS",
    "StudyTable",
    "StudyTableError",
    "Measure",
    "accuracy_study_table",
    "contrast_actions",
    "contrasts_in",
    "default_main_contrast",
    "format_interval",
    "format_value",
    "latex_escape",
    "read_estimands",
    "read_prediction",
    "render_latex",
    "render_markdown",
    "require_estimands",
    "stratum_label",
    "strata_in",
    "table1_timing",
    "table2_decomposition",
    "table3_strata",
    "table4_uncalibrated",
    "write_accuracy_table",
    "write_study_tables",
    "write_table",
]


class StudyTableError(ValueError):
    """An estimands or prediction table lacks what a figure or table needs (one-line message)."""


# ---------------------------------------------------------------------------------------------
# Reading and checking the analysis outputs
# ---------------------------------------------------------------------------------------------


def read_estimands(path: str | os.PathLike) -> pl.DataFrame:
    """Read ``estimands.csv``; empty action/contrast cells become ``""``.

    A table written before the ``draws_dropped`` column existed reads with that column null
    (unknown), so its tables still render.

    Raises :class:`StudyTableError` naming the file when it is missing, lacks a column or
    holds no rows.
    """
    path = Path(path)
    if not path.is_file():
        raise StudyTableError(f"{path}: expected the estimands table, not found")
    table = pl.read_csv(path, infer_schema_length=None)
    if "draws_dropped" not in table.columns:  # written before the column existed: unknown
        table = table.with_columns(draws_dropped=pl.lit(None, dtype=pl.Int64))
    missing = [c for c in ESTIMAND_COLUMNS if c not in table.columns]
    if missing:
        raise StudyTableError(f"{path}: missing column(s) {', '.join(missing)}")
    if table.height == 0:
        raise StudyTableError(f"{path}: expected estimand rows, found none")
    return table.with_columns(
        pl.col("model", "action", "contrast", "stratum", "estimand").cast(pl.String).fill_null(""),
        pl.col("value", "ci_low", "ci_high", "ci_level").cast(pl.Float64),
        pl.col("draws_dropped").cast(pl.Int64),
    ).select(ESTIMAND_COLUMNS)


def read_prediction(path: str | os.PathLike) -> pl.DataFrame:
    """Read ``prediction.csv`` (the prediction rule's long table); empty cells become ``""``."""
    path = Path(path)
    if not path.is_file():
        raise StudyTableError(f"{path}: expected the prediction table, not found")
    table = pl.read_csv(path, infer_schema_length=None)
    missing = [c for c in PREDICTION_COLUMNS if c not in table.columns]
    if missing:
        raise StudyTableError(f"{path}: missing column(s) {', '.join(missing)}")
    return table.with_columns(
        pl.col("model", "observation", "predictor", "contrast", "quantity", "decision")
        .cast(pl.String)
        .fill_null(""),
        pl.col("value", "ci_low", "ci_high", "ci_level").cast(pl.Float64),
    )


def require_estimands(
    table: pl.DataFrame, names: Sequence[str], where: str, needed_by: str
) -> None:
    """Raise one clear line naming the first estimand of ``names`` absent from ``table``."""
    present = set(table["estimand"].unique().to_list())
    for name in names:
        if name not in present:
            raise StudyTableError(f"{where}: estimand {name!r} missing (needed by {needed_by})")


def _natural_key(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def strata_in(table: pl.DataFrame) -> list[str]:
    """The strata of ``table`` other than ``pooled`` (env × length strata), in natural
    order (helmet-4k < helmet-16k < ruler-4k)."""
    found = {s for s in table["stratum"].unique().to_list() if s != "pooled"}
    return sorted(found, key=lambda s: _natural_key(s.lower().replace("k", "000")))


def stratum_label(stratum: str) -> str:
    """``helmet-4k`` → ``HELMET–4K``, the paper's labels of the strata; ``pooled`` stays."""
    if stratum == "pooled":
        return "pooled"
    env, _, length = stratum.partition("-")
    return f"{env.upper()}–{length.upper()}" if length else env.upper()


def contrasts_in(table: pl.DataFrame) -> list[str]:
    """The contrast labels ``b - a`` (of the gap decomposition) of ``table``, in
    order of first appearance."""
    return [c for c in table["contrast"].unique(maintain_order=True).to_list() if c]


def contrast_actions(contrast: str) -> tuple[str, str]:
    """``"b - a"`` → ``("b", "a")``: the actions of the contrast Δ = b − a."""
    b, sep, a = contrast.partition(" - ")
    if not sep or not b or not a:
        raise StudyTableError(f"contrast: expected a label 'b - a', got {contrast!r}")
    return b, a


def default_main_contrast(table: pl.DataFrame, where: str = "estimands") -> str:
    """The first contrast of the table (the first action pair of the study)."""
    found = contrasts_in(table)
    if not found:
        raise StudyTableError(f"{where}: no contrast rows (a study needs two compared actions)")
    return found[0]


def _actions_in(table: pl.DataFrame) -> list[str]:
    return [a for a in table["action"].unique(maintain_order=True).to_list() if a]


def _models_in(table: pl.DataFrame) -> list[str]:
    return table["model"].unique(maintain_order=True).to_list()


# ---------------------------------------------------------------------------------------------
# A rendered table
# ---------------------------------------------------------------------------------------------

_PERCENT, _PP, _STEPS, _COUNT, _TEXT = "percent", "pp", "steps", "count", "text"
HIDDEN = "—"
"""The cell of a share whose ΔR_SMC interval covers 0 (the share is unbounded there)."""
SHARE_NOTE = (
    "— : share not shown, as the interval of ΔR_SMC covers 0 and the share is unbounded there "
    "(the CSV keeps its value and interval)."
)


@dataclass(frozen=True)
class Measure:
    """One estimand shown as a column: its name, header label and unit of display."""

    estimand: str
    label: str
    unit: str = _PERCENT


@dataclass(frozen=True)
class Column:
    """A rendered column: its label, display unit and interval level (``95% CI``; ``""`` for
    none or where the level is given per row)."""

    label: str
    unit: str = _TEXT
    level: str = ""

    @property
    def title(self) -> str:
        """The label with its unit: ``R_SMC, %``."""
        return f"{self.label}{_unit_suffix(self.unit)}"

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
    return 100.0 if unit in (_PERCENT, _PP) else 1.0


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


def _half_width(lo: float | None, hi: float | None) -> float | None:
    return None if _is_missing(lo) or _is_missing(hi) else (hi - lo) / 2


def format_value(x: float | None, unit: str, digits: int = 2) -> str:
    """A value for display (the estimands are fractions): ×100 for percent or percentage points,
    steps as they are, counts as integers; missing or non-finite → ``NA``. A value that rounds
    to zero shows no sign (never ``-0.0``)."""
    if _is_missing(x):
        return "NA"
    if unit == _COUNT:
        return f"{int(round(x)):,}"
    text = f"{_scale(unit) * x:.{digits}f}"
    return text.lstrip("-") if float(text) == 0 else text


def format_interval(
    x: float | None, lo: float | None, hi: float | None, unit: str, digits: int = 2
) -> str:
    """``value [lo, hi]``, a bootstrap percentile interval, in the display unit (no interval
    part when both ends are missing)."""
    return str(_interval_cell(x, lo, hi, unit, digits))


def _interval_cell(
    x: float | None, lo: float | None, hi: float | None, unit: str, digits: int
) -> Cell:
    value = format_value(x, unit, digits)
    if _is_missing(lo) and _is_missing(hi):
        return Cell(value)
    return Cell(value, f"[{format_value(lo, unit, digits)}, {format_value(hi, unit, digits)}]")


def _level_text(levels: Sequence[float]) -> str:
    """``95% CI`` for one level; ``95%/99.375% CI`` when the rows of a column differ."""
    found = sorted({round(float(v), 10) for v in levels if not _is_missing(v)})
    if not found:
        return ""
    return "/".join(f"{100 * v:.10g}%" for v in found) + " CI"


def _unit_suffix(unit: str) -> str:
    return {_PERCENT: ", %", _PP: ", pp", _STEPS: ", steps"}.get(unit, "")


def _covers_zero(lo: float | None, hi: float | None) -> bool:
    """Whether an interval covers 0 (a missing end counts as covering)."""
    return _is_missing(lo) or _is_missing(hi) or lo <= 0.0 <= hi


def _pick(
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
    return out


def _measure_table(
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
    a note explains it.
    """
    records = [dict(r) for r in records]
    if shares:
        for rec in records:
            rec["share_shown"] = not _covers_zero(rec["R_smc_low"], rec["R_smc_high"])
    data = pl.DataFrame(records, infer_schema_length=None)
    columns = [Column(label) for _, label in keys]
    digits: dict[str, int] = {}
    for m in measures:
        if m.unit == _COUNT:
            columns.append(Column(m.label, _COUNT))
            continue
        columns.append(Column(m.label, m.unit, _level_text(data[f"{m.estimand}_level"].to_list())))
        widths = [_half_width(r[f"{m.estimand}_low"], r[f"{m.estimand}_high"]) for r in records]
        digits[m.estimand] = decimals_for(widths, m.unit)
    rows = []
    hidden = False
    for rec in records:
        row: list[str] = [str(rec[k]) for k, _ in keys]
        for m in measures:
            if m.unit == _COUNT:
                row.append(Cell(format_value(rec[m.estimand], _COUNT)))
            elif m.estimand in shares and not rec["share_shown"]:
                row.append(Cell(HIDDEN))
                hidden = True
            else:
                v, lo, hi = (rec[m.estimand], rec[f"{m.estimand}_low"], rec[f"{m.estimand}_high"])
                row.append(_interval_cell(v, lo, hi, m.unit, digits[m.estimand]))
        rows.append(row)
    notes = (SHARE_NOTE,) if hidden else ()
    header = [c.header for c in columns]
    return StudyTable(
        name, caption, data, header, rows, group_columns=1, columns=tuple(columns), notes=notes
    )


# ---------------------------------------------------------------------------------------------
# Tables 1–4
# ---------------------------------------------------------------------------------------------

TABLE1_MEASURES = (
    Measure("R_smc", "R_SMC"),
    Measure("O_H", "O_H"),
    Measure("E_H", "E_H"),
    Measure("C_H", "C_H"),
    Measure("Pi_H", "Π_H"),
    Measure("mean_entry_time", "E[τ | τ ≤ H]", _STEPS),
    Measure("S_99", "S_.99"),
)
TABLE2_MEASURES = (
    Measure("R_smc", "ΔR_SMC", _PP),
    Measure("gap_occurrence", "occurrence", _PP),
    Measure("gap_exposure", "exposure", _PP),
    Measure("gap_rate", "rate", _PP),
    Measure("occurrence_share", "occurrence share"),
    Measure("exposure_share", "exposure share"),
    Measure("rate_share", "rate share"),
)
TABLE3_CONTRAST_MEASURES = (
    Measure("R_smc", "ΔR_SMC", _PP),
    Measure("gap_exposure", "exposure term", _PP),
    Measure("exposure_share", "exposure share"),
    Measure("block_tv_change", "Δg", _PP),
    Measure("R_minus_F", "Δ(R − F)", _PP),
)
TABLE4_QUANTITIES = (
    ("R", "Full-H rollout-TV gap"),
    ("F", "Fixed-history gap"),
    ("flat_extrapolation", "Flat-extrapolation gap"),
    ("R_minus_F", "Full minus fixed history"),
    ("R_minus_flat", "Full minus flat extrapolation"),
)
_OBSERVATION_LABELS = {"positions_1_32": "early positions", "fixed_history": "fixed history"}


def table1_timing(
    table: pl.DataFrame, actions: Sequence[str] | None = None, where: str = "estimands"
) -> StudyTable:
    """Table 1: timing and occupation per model × action, pooled.

    ``actions`` (default: every action of the table) fixes rows and order; pass the study's
    compared actions to leave out the full-retention control.
    """
    needed = "table 1"
    counts = (Measure("branch_cohort_docs", "cohort docs", _COUNT),)
    counts += (Measure("branch_cohort_paths", "cohort paths", _COUNT),)
    require_estimands(table, [m.estimand for m in TABLE1_MEASURES + counts], where, needed)
    actions = list(actions) if actions is not None else _actions_in(table)
    records = []
    for model in _models_in(table):
        for action in actions:
            rec = {"model": model, "action": action}
            rec |= _pick(table, where, needed, TABLE1_MEASURES, model=model, action=action)
            got = _pick(table, where, needed, counts, model=model, action=action)
            rec |= {m.estimand: got[m.estimand] for m in counts}
            rows = table.filter(
                (pl.col("model") == model)
                & (pl.col("action") == action)
                & (pl.col("stratum") == "pooled")
                & (pl.col("estimand") == "R_smc")
            )
            rec["n_docs"], rec["n_paths"] = rows["n_docs"][0], rows["n_paths"][0]
            records.append(rec)
    caption = (
        "Timing and occupation per model and action (all strata pooled): token-mismatch risk "
        "R_SMC = O_H + Π_H, occurrence O_H = P(τ ≤ H)/H, post-divergence exposure E_H, "
        "post-divergence mismatch rate C_H, post-divergence component Π_H = E_H·C_H, mean "
        "entry time among diverging paths, saturation S_.99, and the fixed branch cohort's "
        "documents and paths. Percent of the horizon; document-bootstrap intervals."
    )
    measures = TABLE1_MEASURES + counts
    return _measure_table(
        "table1", caption, [("model", "Model"), ("action", "Action")], records, measures
    )


def table2_decomposition(
    table: pl.DataFrame, contrasts: Sequence[str] | None = None, where: str = "estimands"
) -> StudyTable:
    """Table 2: ΔR_SMC = occurrence + exposure + rate terms, with shares, pooled."""
    needed = "table 2"
    require_estimands(table, [m.estimand for m in TABLE2_MEASURES], where, needed)
    contrasts = list(contrasts) if contrasts is not None else contrasts_in(table)
    if not contrasts:
        raise StudyTableError(f"{where}: no contrast rows (needed by {needed})")
    records = []
    for model in _models_in(table):
        for contrast in contrasts:
            rec = {"model": model, "contrast": contrast}
            rec |= _pick(table, where, needed, TABLE2_MEASURES, model=model, contrast=contrast)
            records.append(rec)
    caption = (
        "Gap decomposition per contrast b − a (all strata pooled): ΔR_SMC = ΔO_H + ΔE_H·C̄_H "
        "+ ΔC_H·Ē_H (occurrence, exposure and rate terms, in percentage points), exact on the "
        "empirical moments; each share divides its term by ΔR_SMC. Document-bootstrap "
        "intervals, paired across actions."
    )
    return _measure_table(
        "table2",
        caption,
        [("model", "Model"), ("contrast", "Contrast")],
        records,
        TABLE2_MEASURES,
        shares=("occurrence_share", "exposure_share", "rate_share"),
    )


def table3_strata(
    table: pl.DataFrame, contrast: str | None = None, where: str = "estimands"
) -> StudyTable:
    """Table 3: the main contrast per model × stratum (pooled last), with B(a) of both actions.

    Columns: ΔR_SMC, its exposure term and share, the generation-clock change Δg
    (g_last block − g_first block), Δ(R − F), and the branch contrast B of each action of the
    contrast (the divergence clock).
    """
    needed = "table 3"
    contrast = contrast or default_main_contrast(table, where)
    b, a = contrast_actions(contrast)
    branch = (Measure("branch_contrast_B", "B", _PP),)
    require_estimands(
        table, [m.estimand for m in TABLE3_CONTRAST_MEASURES] + ["branch_contrast_B"], where, needed
    )
    if contrast not in contrasts_in(table):
        raise StudyTableError(f"{where}: no rows for contrast {contrast!r} (needed by {needed})")
    strata = [*strata_in(table), "pooled"]
    records = []
    for model in _models_in(table):
        for stratum in strata:
            rec = {"model": model, "stratum": stratum}
            rec |= _pick(
                table,
                where,
                needed,
                TABLE3_CONTRAST_MEASURES,
                model=model,
                contrast=contrast,
                stratum=stratum,
            )
            for action, key in ((b, "B_minuend"), (a, "B_subtrahend")):
                got = _pick(
                    table, where, needed, branch, model=model, action=action, stratum=stratum
                )
                rec |= {
                    key: got["branch_contrast_B"],
                    f"{key}_low": got["branch_contrast_B_low"],
                    f"{key}_high": got["branch_contrast_B_high"],
                    f"{key}_level": got["branch_contrast_B_level"],
                }
            records.append(rec)
    measures = TABLE3_CONTRAST_MEASURES + (
        Measure("B_minuend", f"B: {b}", _PP),
        Measure("B_subtrahend", f"B: {a}", _PP),
    )
    caption = (
        f"The contrast {contrast} per stratum (pooled last): ΔR_SMC, its exposure term and "
        "share, the generation-clock change Δg = g(last block) − g(first block), Δ(R − F), and "
        "each action's branch contrast B = late − early branch TV within its fixed branch "
        "cohort. Percentage points; document-bootstrap intervals."
    )
    return _measure_table(
        "table3",
        caption,
        [("model", "Model"), ("stratum", "Stratum")],
        records,
        measures,
        shares=("exposure_share",),
    )


def table4_uncalibrated(
    table: pl.DataFrame,
    prediction: pl.DataFrame | None = None,
    contrast: str | None = None,
    where: str = "estimands",
) -> StudyTable:
    """Table 4: uncalibrated contrasts of the main contrast, then its predictions.

    Rows are quantities, columns models. From the estimands (pooled contrast rows): ``R``
    (full-H rollout-TV gap), ``F`` (fixed-history gap), ``flat_extrapolation``, ``R_minus_F``,
    ``R_minus_flat``. From ``prediction`` (rows of the same contrast only): per observation,
    the selected predictor's ``error`` with its interval and decision, ``mae`` and ``rmse``.
    The CSV is long: model, section, quantity, label, value, ci_low, ci_high, ci_level,
    decision, predictor.
    """
    needed = "table 4"
    contrast = contrast or default_main_contrast(table, where)
    require_estimands(table, [q for q, _ in TABLE4_QUANTITIES], where, needed)
    if contrast not in contrasts_in(table):
        raise StudyTableError(f"{where}: no rows for contrast {contrast!r} (needed by {needed})")
    models = _models_in(table)
    records = []
    for model in models:
        got = _pick(
            table,
            where,
            needed,
            [Measure(q, label) for q, label in TABLE4_QUANTITIES],
            model=model,
            contrast=contrast,
        )
        for q, label in TABLE4_QUANTITIES:
            records.append(
                {
                    "model": model,
                    "section": "uncalibrated",
                    "quantity": q,
                    "label": label,
                    "value": got[q],
                    "ci_low": got[f"{q}_low"],
                    "ci_high": got[f"{q}_high"],
                    "ci_level": got[f"{q}_level"],
                    "decision": "",
                    "predictor": "",
                }
            )
    if prediction is not None:
        chosen = prediction.filter(
            (pl.col("contrast") == contrast)
            & pl.col("quantity").is_in(["error", "mae", "rmse"])
            & pl.col("model").is_in(models)
        )
        for r in chosen.iter_rows(named=True):
            obs = _OBSERVATION_LABELS.get(r["observation"], r["observation"].replace("_", " "))
            what = {"error": "error", "mae": "MAE", "rmse": "RMSE"}[r["quantity"]]
            records.append(
                {
                    "model": r["model"],
                    "section": "prediction",
                    "quantity": f"{r['observation']}:{r['quantity']}",
                    "label": f"Prediction {what}, {obs}",
                    "value": r["value"],
                    "ci_low": r["ci_low"],
                    "ci_high": r["ci_high"],
                    "ci_level": r["ci_level"],
                    "decision": r["decision"],
                    "predictor": r["predictor"],
                }
            )
    data = pl.DataFrame(
        records,
        schema={
            "model": pl.String,
            "section": pl.String,
            "quantity": pl.String,
            "label": pl.String,
            "value": pl.Float64,
            "ci_low": pl.Float64,
            "ci_high": pl.Float64,
            "ci_level": pl.Float64,
            "decision": pl.String,
            "predictor": pl.String,
        },
    )
    quantities = data.select("quantity", "label").unique(maintain_order=True)
    rows = []
    for quantity, label in quantities.iter_rows():
        sub = data.filter(pl.col("quantity") == quantity)
        level = _level_text(sub["ci_level"].to_list())
        predictor = next((p for p in sub["predictor"].to_list() if p), "")
        text = label + (f" ({predictor.replace('_', ' ')})" if predictor else "")
        row: list[str] = [text + (f" [{level}]" if level else "")]
        widths = [_half_width(lo, hi) for lo, hi in sub.select("ci_low", "ci_high").iter_rows()]
        digits = decimals_for(widths, _PP)
        for model in models:
            cell = sub.filter(pl.col("model") == model)
            if cell.height == 0:
                row.append(Cell(""))
                continue
            r = cell.row(0, named=True)
            shown = _interval_cell(r["value"], r["ci_low"], r["ci_high"], _PP, digits)
            extra = [r["decision"]] if r["decision"] else []
            if r["predictor"] and r["predictor"] != predictor:
                extra.append(f"({r['predictor'].replace('_', ' ')})")
            if extra:
                shown = Cell(shown.value, " ".join([shown.interval, *extra]).strip())
            row.append(shown)
        rows.append(row)
    caption = (
        f"Uncalibrated contrasts for {contrast} (pp): full-horizon rollout-TV gap ΔR, "
        "fixed-history gap ΔF, flat extrapolation of the early-position mismatch, and their "
        "differences; then the development-selected aggregate predictions of the contrast "
        "(error of the predicted population-average contrast with its interval and the "
        "equivalence decision, and document-contrast MAE and RMSE)."
    )
    columns = (Column("Quantity, pp"), *(Column(m) for m in models))
    header = [c.header for c in columns]
    return StudyTable("table4", caption, data, header, rows, group_columns=0, columns=columns)


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def _grouped(table: StudyTable) -> list[list[str]]:
    """Rows with repeated leading group values blanked (the paper's layout)."""
    out, previous = [], None
    for row in table.rows:
        key = tuple(row[: table.group_columns])
        shown = list(row)
        if table.group_columns and key == previous:
            shown[: table.group_columns] = [""] * table.group_columns
        previous = key
        out.append(shown)
    return out


def _groups(table: StudyTable) -> list[tuple[str, list[list[str]]]]:
    """Rows split into their groups (the first column's value), in order; one unnamed group
    for a table without group columns."""
    if not table.group_columns:
        return [("", [list(r) for r in table.rows])]
    out: list[tuple[str, list[list[str]]]] = []
    for row in table.rows:
        if not out or out[-1][0] != row[0]:
            out.append((str(row[0]), []))
        out[-1][1].append(list(row))
    return out


def _title(name: str) -> str:
    """``table3`` → ``Table 3``; ``tableA`` (the accuracy table) → ``Table A``."""
    return re.sub(r"^table(\d+|[A-Z])$", r"Table \1", name)


def render_markdown(table: StudyTable) -> str:
    """A study table as GitHub-flavoured Markdown: its caption as a leading paragraph, its
    notes after the table."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [f"**{_title(table.name)}.** {table.caption}", ""]
    lines.append("| " + " | ".join(cell(h) for h in table.header) + " |")
    n_text = table.group_columns + 1 if table.group_columns else 1
    rule = [":---" if i < n_text else "---:" for i in range(len(table.header))]
    lines.append("|" + "|".join(rule) + "|")
    for row in _grouped(table):
        lines.append("| " + " | ".join(cell(c) for c in row) + " |")
    for note in table.notes:
        lines += ["", f"*Note.* {note}"]
    return "\n".join(lines) + "\n"


_LATEX_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}
_LATEX_TOKENS = {
    "E[τ | τ ≤ H]": r"$E[\tau \mid \tau \leq H]$",
    "R_SMC": r"$R_{\mathrm{SMC}}$",
    "S_.99": r"$S_{.99}$",
    "C̄_H": r"$\bar{C}_H$",
    "Ē_H": r"$\bar{E}_H$",
    "O_H": r"$O_H$",
    "E_H": r"$E_H$",
    "C_H": r"$C_H$",
    "Π_H": r"$\Pi_H$",
    "τ": r"$\tau$",
    "Π": r"$\Pi$",
    "Δ": r"$\Delta$",
    "≤": r"$\leq$",
    "−": r"$-$",
    "—": "---",
    "–": "--",
    "·": r"$\cdot$",
}
_LATEX_TOKEN_PATTERN = re.compile(
    "|".join(re.escape(t) for t in sorted(_LATEX_TOKENS, key=len, reverse=True))
)


_NEGATIVE = re.compile(r"(?<![\w$])-(?=\d)")  # the sign of a number, not a hyphen in a name

MAX_LATEX_COLUMNS = 5
"""The most value columns of one LaTeX panel: a wider table is split into stacked panels."""


def latex_escape(text: str) -> str:
    """Escape LaTeX specials; typeset the estimand symbols of captions and headers as math."""
    parts, last = [], 0
    for match in _LATEX_TOKEN_PATTERN.finditer(text):
        parts.append("".join(_LATEX_SPECIAL.get(ch, ch) for ch in text[last : match.start()]))
        parts.append(_LATEX_TOKENS[match.group()])
        last = match.end()
    parts.append("".join(_LATEX_SPECIAL.get(ch, ch) for ch in text[last:]))
    return "".join(parts)


def _latex_number(text: str) -> str:
    return _NEGATIVE.sub("$-$", latex_escape(text))


def latex_panels(n_values: int, most: int = MAX_LATEX_COLUMNS) -> list[range]:
    """Split ``n_values`` value columns into the fewest panels of at most ``most`` columns,
    as even as possible (9 → 5 + 4, 7 → 4 + 3)."""
    count = max(1, math.ceil(n_values / most))
    size, extra = divmod(n_values, count)
    panels, start = [], 0
    for k in range(count):
        stop = start + size + (1 if k < extra else 0)
        panels.append(range(start, stop))
        start = stop
    return panels


LATEX_WRAP_AT = 36
"""Row labels longer than this many characters wrap in a column of :data:`LATEX_WRAP_WIDTH`."""
LATEX_WRAP_WIDTH = "5cm"


def _latex_key_spec(table: StudyTable, k: int) -> str:
    """``l`` for a label column, or a wrapping ``p{…}`` where its labels are long."""
    longest = max((len(str(row[k])) for row in table.rows), default=0)
    return f"p{{{LATEX_WRAP_WIDTH}}}" if longest > LATEX_WRAP_AT else "l"


def render_latex(
    table: StudyTable, label: str | None = None, max_columns: int = MAX_LATEX_COLUMNS
) -> str:
    """A study table as a booktabs ``table*`` (``\\toprule``, ``\\midrule``, ``\\bottomrule``;
    needs ``\\usepackage{booktabs}``) that fits the text width.

    Each value sits over its interval (a second, smaller line), so that columns stay narrow;
    long row labels wrap (:data:`LATEX_WRAP_AT`); a table with more than ``max_columns`` value
    columns is split into stacked panels (a), (b),
    … that repeat the row labels; a group (a model) is a heading row instead of a column;
    interval levels go under the column labels; numbers carry a true minus sign; the notes
    follow the panels.
    """
    columns = table.described_columns()
    n_keys, n_groups = table.key_columns, table.group_columns
    values = list(range(n_keys, len(columns)))
    panels = latex_panels(len(values), max_columns)
    lines = [
        r"\begin{table*}[t]",
        r"\centering",
        r"\small",
        r"\setlength{\tabcolsep}{4pt}",
        rf"\caption{{{latex_escape(table.caption)}}}",
        rf"\label{{{label or 'tab:' + table.name}}}",
    ]
    for p, panel in enumerate(panels):
        shown = [values[i] for i in panel]
        keys = list(range(n_groups, n_keys))
        width = len(keys) + len(shown)
        if p:
            lines.append(r"\medskip")
        spec = "".join(_latex_key_spec(table, k) for k in keys) + "r" * len(shown)
        lines += [rf"\begin{{tabular}}{{{spec}}}", r"\toprule"]
        titles = [latex_escape(columns[k].title) for k in keys + shown]
        if len(panels) > 1:
            titles[0] = f"({chr(ord('a') + p)}) {titles[0]}"
        lines.append(" & ".join(titles) + r" \\")
        levels = [columns[k].level for k in shown]
        if any(levels):
            cells = [""] * len(keys) + [
                rf"{{\footnotesize {latex_escape(v)}}}" if v else "" for v in levels
            ]
            lines.append(" & ".join(cells) + r" \\")
        lines.append(r"\midrule")
        for g, (group, rows) in enumerate(_groups(table)):
            if group:
                if g:
                    lines.append(r"\addlinespace")
                lines.append(
                    rf"\multicolumn{{{width}}}{{@{{}}l}}{{\textit{{{latex_escape(group)}}}}} \\"
                )
            for row in rows:
                cells = [latex_escape(str(row[k])) for k in keys]
                cells += [_latex_number(getattr(row[k], "value", str(row[k]))) for k in shown]
                lines.append(" & ".join(cells) + r" \\")
                intervals = [getattr(row[k], "interval", "") for k in shown]
                if any(intervals):
                    cells = [""] * len(keys) + [
                        rf"{{\footnotesize {_latex_number(v)}}}" if v else "" for v in intervals
                    ]
                    lines.append(" & ".join(cells) + r" \\")
        lines += [r"\bottomrule", r"\end{tabular}"]
    for note in table.notes:
        lines.append(rf"\par\smallskip{{\footnotesize {latex_escape(note)}\par}}")
    lines.append(r"\end{table*}")
    return "\n".join(lines) + "\n"


HTML_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif;
       font-size: 14px; color: #1a1a1a; margin: 16px; }
h1 { font-size: 18px; } h2 { font-size: 15px; margin-top: 20px; }
table.study { border-collapse: collapse; border-top: 2px solid #333;
              border-bottom: 2px solid #333; font-variant-numeric: tabular-nums;
              margin: 8px 0 4px; }
table.study caption { caption-side: top; text-align: left; max-width: 75em;
                      line-height: 1.45; padding-bottom: 8px; }
table.study th, table.study td { padding: 3px 10px; vertical-align: top; }
table.study thead th { border-bottom: 1px solid #333; text-align: right; font-weight: 600; }
table.study th.key, table.study td.key { text-align: left; }
table.study td.num { text-align: right; white-space: nowrap; }
table.study td.key { white-space: nowrap; }
table.study .ci, table.study .level { display: block; color: #666; font-size: 12px;
                                       font-weight: normal; }
table.study tr.group td { font-style: italic; font-weight: 600; padding-top: 9px;
                          border-top: 1px solid #ccc; }
table.study tr.group:first-child td { border-top: none; }
p.note { font-size: 12px; color: #444; max-width: 75em; }
"""


_HTML_TOKENS = {
    "R_SMC": "R<sub>SMC</sub>",
    "S_.99": "S<sub>.99</sub>",
    "C̄_H": "C̄<sub>H</sub>",
    "Ē_H": "Ē<sub>H</sub>",
    "O_H": "O<sub>H</sub>",
    "E_H": "E<sub>H</sub>",
    "C_H": "C<sub>H</sub>",
    "Π_H": "Π<sub>H</sub>",
}
_HTML_TOKEN_PATTERN = re.compile("|".join(re.escape(t) for t in _HTML_TOKENS))


def _html_text(text: str) -> str:
    """Escaped, with the estimand symbols' subscripts set as subscripts."""
    return _HTML_TOKEN_PATTERN.sub(lambda m: _HTML_TOKENS[m.group()], escape(text))


def _html_number(text: str) -> str:
    """Escaped, with a true minus sign on negative numbers."""
    return _NEGATIVE.sub("\N{MINUS SIGN}", escape(text))


def _html_table(table: StudyTable, caption: bool = True) -> str:
    """The ``<table>`` element of a study table (and its notes)."""
    columns = table.described_columns()
    n_keys, n_groups = table.key_columns, table.group_columns
    keys = list(range(n_groups, n_keys))
    shown = list(range(n_keys, len(columns)))
    out = ['<table class="study">']
    if caption:
        out.append(
            f"<caption><b>{escape(_title(table.name))}.</b> {_html_text(table.caption)}</caption>"
        )
    out.append("<thead><tr>")
    for k in keys:
        out.append(f'<th class="key">{_html_text(columns[k].title)}</th>')
    for k in shown:
        level = columns[k].level
        extra = f'<span class="level">{escape(level)}</span>' if level else ""
        out.append(f"<th>{_html_text(columns[k].title)}{extra}</th>")
    out.append("</tr></thead><tbody>")
    for group, rows in _groups(table):
        if group:
            span = len(keys) + len(shown)
            out.append(f'<tr class="group"><td colspan="{span}">{escape(group)}</td></tr>')
        for row in rows:
            out.append("<tr>")
            out += [f'<td class="key">{_html_text(str(row[k]))}</td>' for k in keys]
            for k in shown:
                cell = row[k]
                value = _html_number(getattr(cell, "value", str(cell)))
                interval = getattr(cell, "interval", "")
                extra = f'<span class="ci">{_html_number(interval)}</span>' if interval else ""
                out.append(f'<td class="num">{value}{extra}</td>')
            out.append("</tr>")
    out.append("</tbody></table>")
    out += [f'<p class="note">{_html_text(note)}</p>' for note in table.notes]
    return "\n".join(out)


def html_document(title: str, body: str) -> str:
    """A self-contained HTML page (inline style, no scripts) around ``body``."""
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>\n'
        f"<style>{HTML_STYLE}</style></head>\n<body>\n{body}\n</body></html>\n"
    )


def render_html(table: StudyTable) -> str:
    """A study table as a self-contained HTML page (the report shows it inline): caption,
    the model groups as heading rows, each interval on a line under its value, notes."""
    return html_document(_title(table.name), _html_table(table))


def write_table(
    table: StudyTable,
    csv: str | os.PathLike,
    markdown: str | os.PathLike,
    latex: str | os.PathLike,
    html: str | os.PathLike | None = None,
) -> None:
    """Write a study table: CSV (fractions), Markdown, LaTeX and, given a path, HTML, each
    atomically."""
    with atomic_path(csv, suffix=".csv") as tmp:
        table.data.write_csv(tmp)
    atomic_write_text(markdown, render_markdown(table))
    atomic_write_text(latex, render_latex(table))
    if html is not None:
        atomic_write_text(html, render_html(table))


def write_study_tables(
    estimands_csv: str | os.PathLike,
    prediction_csv: str | os.PathLike | None,
    outputs: Mapping[str, Sequence[str | os.PathLike]],
    actions: Sequence[str] | None = None,
    main_contrast: str | None = None,
) -> dict[str, StudyTable]:
    """Build Tables 1–4 of one study and write each as CSV, Markdown, LaTeX (and HTML).

    ``outputs`` maps ``table1``…``table4`` to their paths: (CSV, Markdown, LaTeX) or
    (CSV, Markdown, LaTeX, HTML). ``actions``: Table 1's rows (default: every action);
    ``main_contrast``: Tables 3–4's contrast (default: the first). Every input is read and
    every table built before anything is written.
    """
    unknown = sorted(set(outputs) - {"table1", "table2", "table3", "table4"})
    if unknown:
        raise StudyTableError(f"outputs: unknown table(s) {', '.join(unknown)}")
    where = str(estimands_csv)
    table = read_estimands(estimands_csv)
    prediction = read_prediction(prediction_csv) if prediction_csv is not None else None
    if actions is not None:
        absent = [a for a in actions if a not in set(table["action"].to_list())]
        if absent:
            raise StudyTableError(f"{where}: no rows for action {absent[0]!r}")
    built = {
        "table1": table1_timing(table, actions, where),
        "table2": table2_decomposition(table, None, where),
        "table3": table3_strata(table, main_contrast, where),
        "table4": table4_uncalibrated(table, prediction, main_contrast, where),
    }
    for name, paths in outputs.items():
        write_table(built[name], *paths)
    return built


# ---------------------------------------------------------------------------------------------
# Task accuracy beside divergence
# ---------------------------------------------------------------------------------------------

ACCURACY_MEASURES = (
    Measure("accuracy_x", "full cache"),
    Measure("accuracy_y", "action"),
    Measure("accuracy_drop", "drop", _PP),
    Measure("share@early", "early share"),
    Measure("accuracy_drop@early", "drop | early", _PP),
    Measure("share@late", "late share"),
    Measure("accuracy_drop@late", "drop | late", _PP),
)


def accuracy_study_table(
    table: pl.DataFrame, actions: Sequence[str] | None = None, where: str = "accuracy"
) -> StudyTable:
    """The accuracy table per model × action, pooled, from the long accuracy table
    (:func:`kvdiverge.analysis.accuracy.accuracy_table`): task accuracy of the full cache (X)
    and of the action (Y), the drop X − Y, and by divergence timing the share of paths that
    diverged early or late and the drop among them (paths that never diverge have equal X and
    Y, so no drop)."""
    needed = "the accuracy table"
    require_estimands(table, [m.estimand for m in ACCURACY_MEASURES], where, needed)
    actions = list(actions) if actions is not None else _actions_in(table)
    records = []
    for model in _models_in(table):
        for action in actions:
            rec = {"model": model, "action": action}
            rec |= _pick(table, where, needed, ACCURACY_MEASURES, model=model, action=action)
            row = table.filter(
                (pl.col("model") == model)
                & (pl.col("action") == action)
                & (pl.col("stratum") == "pooled")
                & (pl.col("estimand") == "accuracy_x")
            )
            rec["n_docs"], rec["n_paths"] = row["n_docs"][0], row["n_paths"][0]
            records.append(rec)
    caption = (
        "Task accuracy per model and action (all strata pooled), each generation scored with "
        "its source's metric: the full cache (X) and the action's cache (Y) on the same "
        "coupled paths, the drop X − Y (percentage points; paired document-bootstrap "
        "intervals), and by divergence timing the share of paths that diverged early "
        "(τ ≤ H/2) or late (H/2 < τ ≤ H) with the drop among them. Paths that never diverge "
        "within H generate the same text under both caches."
    )
    return _measure_table(
        "tableA",
        caption,
        [("model", "Model"), ("action", "Action")],
        records,
        ACCURACY_MEASURES,
    )


def write_accuracy_table(
    accuracy_csv: str | os.PathLike,
    outputs: Sequence[str | os.PathLike],
    actions: Sequence[str] | None = None,
) -> StudyTable:
    """Read the long accuracy CSV and write its table as (CSV, Markdown, LaTeX, HTML)."""
    table = read_estimands(accuracy_csv)
    built = accuracy_study_table(table, actions, str(accuracy_csv))
    write_table(built, *outputs)
    return built


# ---------------------------------------------------------------------------------------------
# The estimands: a tidy typed copy and a short summary
# ---------------------------------------------------------------------------------------------

ESTIMAND_GLOSSARY = {
    "R_smc": "token-mismatch risk R_SMC = O_H + Π_H",
    "O_H": "occurrence O_H = P(τ ≤ H)/H",
    "E_H": "post-divergence exposure E_H",
    "C_H": "post-divergence mismatch rate C_H",
    "Pi_H": "post-divergence component Π_H = E_H·C_H",
    "div_prob": "divergence probability P(τ ≤ H)",
    "mean_entry_time": "mean entry time E[τ | τ ≤ H]",
    "R": "rollout-TV risk R (mean rollout TV)",
    "F": "fixed-history risk F",
    "R_minus_F": "R − F",
    "S_99": "saturation S_.99 = mean over t of P(δ_t > .99)",
    "block_tv_change": "generation-clock change: last − first block of E[δ_t]",
    "branch_cohort_fraction": "branch cohort P(τ ≤ d)",
    "branch_cohort_docs": "documents in the branch cohort",
    "branch_cohort_paths": "paths in the branch cohort",
    "branch_early": "branch TV, early lag window",
    "branch_late": "branch TV, late lag window",
    "branch_contrast_B": "branch contrast B = late − early",
    "branch_pre_early": "branch TV before EOS, early window",
    "branch_pre_late": "branch TV before EOS, late window",
    "branch_pre_contrast_B": "branch contrast before EOS",
    "rf_S0": "R − F in EOS segment S0 (before either EOS)",
    "rf_S1": "R − F in EOS segment S1",
    "rf_S2": "R − F in EOS segment S2",
    "rf_S3": "R − F in EOS segment S3",
    "pre_eos_share": "share of R − F before EOS",
    "eos_share": "share of R − F at or after EOS",
    "local_agreement_run": "branch cohort: a run of agreements after τ",
    "local_reentry": "branch cohort: a mismatch after re-agreeing",
    "flat_extrapolation": "flat extrapolation of the early-position mismatch",
    "R_minus_flat": "R − flat extrapolation",
    "gap_occurrence": "occurrence term ΔO_H of ΔR_SMC",
    "gap_exposure": "exposure term ΔE_H·C̄_H of ΔR_SMC",
    "gap_rate": "rate term ΔC_H·Ē_H of ΔR_SMC",
    "occurrence_share": "occurrence term / ΔR_SMC",
    "exposure_share": "exposure term / ΔR_SMC",
    "rate_share": "rate term / ΔR_SMC",
}
"""One line per scalar estimand name of ``estimands.csv``."""
PROFILE_GLOSSARY = {
    "div_cdf": "divergence CDF P(τ ≤ t)",
    "tv": "generation clock E[δ_t]",
    "block_tv": "block means of E[δ_t] (blocks a:b)",
    "branch_tv": "divergence clock b_j = E[δ_{τ+j} | τ ≤ d]",
    "branch_pre_tv": "divergence clock before EOS",
}
"""One line per profile (estimands named ``name@x``)."""
SUMMARY_ACTION_ESTIMANDS = (
    "R_smc",
    "O_H",
    "Pi_H",
    "div_prob",
    "mean_entry_time",
    "R",
    "F",
    "S_99",
    "branch_contrast_B",
)
SUMMARY_CONTRAST_ESTIMANDS = (
    "R_smc",
    "gap_occurrence",
    "gap_exposure",
    "gap_rate",
    "div_prob",
    "R",
    "F",
    "R_minus_F",
    "block_tv_change",
    "branch_contrast_B",
)
_COUNT_ESTIMANDS = ("branch_cohort_docs", "branch_cohort_paths")


def _summary_unit(estimand: str, contrast: bool) -> str:
    if estimand in _COUNT_ESTIMANDS:
        return _COUNT
    if estimand == "mean_entry_time":
        return _STEPS
    if contrast or estimand.endswith("contrast_B"):
        return _PP
    return _PERCENT


def tidy_estimands(table: pl.DataFrame) -> pl.DataFrame:
    """The estimands table with typed columns: ``kind`` (``action`` or ``contrast``), null
    instead of ``""`` for an absent action or contrast, and a profile's name split into
    ``estimand`` and ``at`` (``div_cdf@12`` → ``div_cdf``, ``"12"``; ``block_tv@1:8`` →
    ``block_tv``, ``"1:8"``) with ``index`` its integer where it is one."""
    parts = pl.col("estimand").str.split_exact("@", 1)
    return table.select(
        "model",
        kind=pl.when(pl.col("contrast") != "").then(pl.lit("contrast")).otherwise(pl.lit("action")),
        action=pl.when(pl.col("action") != "").then(pl.col("action")),
        contrast=pl.when(pl.col("contrast") != "").then(pl.col("contrast")),
        stratum=pl.col("stratum"),
        estimand=parts.struct.field("field_0"),
        at=parts.struct.field("field_1"),
        index=parts.struct.field("field_1").cast(pl.Int64, strict=False),
        value=pl.col("value"),
        ci_low=pl.col("ci_low"),
        ci_high=pl.col("ci_high"),
        ci_level=pl.col("ci_level"),
        n_docs=pl.col("n_docs").cast(pl.Int64),
        n_paths=pl.col("n_paths").cast(pl.Int64),
        draws_dropped=pl.col("draws_dropped"),
    )


def _summary_table(
    table: pl.DataFrame,
    name: str,
    caption: str,
    estimands: Sequence[str],
    by: str,
) -> StudyTable | None:
    """Pooled estimates, one row per model × estimand, one column per action (``by="action"``)
    or contrast; the decimals of a row follow its intervals."""
    columns_of = _actions_in(table) if by == "action" else contrasts_in(table)
    if not columns_of:
        return None
    present = set(table["estimand"].unique().to_list())
    estimands = [e for e in estimands if e in present]
    pooled = table.filter(
        (pl.col("stratum") == "pooled") & pl.col("estimand").is_in(estimands) & (pl.col(by) != "")
    )
    rows, records = [], []
    for model in _models_in(table):
        for estimand in estimands:
            cells = pooled.filter((pl.col("model") == model) & (pl.col("estimand") == estimand))
            by_key = {r[by]: r for r in cells.iter_rows(named=True)}
            unit = _summary_unit(estimand, by == "contrast")
            widths = [_half_width(r["ci_low"], r["ci_high"]) for r in by_key.values()]
            digits = decimals_for(widths, unit)
            label = f"{estimand}: {ESTIMAND_GLOSSARY.get(estimand, estimand)}{_unit_suffix(unit)}"
            row: list[str] = [model, label]
            for key in columns_of:
                r = by_key.get(key)
                if r is None:
                    row.append(Cell(""))
                elif unit == _COUNT:
                    row.append(Cell(format_value(r["value"], _COUNT)))
                else:
                    row.append(_interval_cell(r["value"], r["ci_low"], r["ci_high"], unit, digits))
                if r is not None:
                    records.append({"model": model, by: key, "estimand": estimand})
            rows.append(row)
    level = _level_text(pooled["ci_level"].to_list())
    columns = (Column("Model"), Column("Estimand"), *(Column(c, level=level) for c in columns_of))
    header = [c.header for c in columns]
    data = pl.DataFrame(records, schema={"model": pl.String, by: pl.String, "estimand": pl.String})
    return StudyTable(name, caption, data, header, rows, group_columns=1, columns=columns)


@dataclass(frozen=True)
class EstimandsSummary:
    """A short account of ``estimands.csv``: what it holds (``facts``), two tables of pooled
    headline estimates (per action, per contrast) and the glossary of every name it holds."""

    title: str
    facts: list[str]
    tables: list[StudyTable]
    glossary: list[tuple[str, str]]


def estimands_summary(
    table: pl.DataFrame, study: str = "", where: str = "estimands"
) -> EstimandsSummary:
    """Summarize the estimands table (as :func:`read_estimands` returns it) in a page."""
    if table.height == 0:
        raise StudyTableError(f"{where}: expected estimand rows, found none")
    names = table["estimand"].unique(maintain_order=True).to_list()
    scalars = [n for n in names if "@" not in n]
    profiles: dict[str, list[str]] = {}
    for n in names:
        if "@" in n:
            base, _, at = n.partition("@")
            profiles.setdefault(base, []).append(at)
    models, actions, contrasts = _models_in(table), _actions_in(table), contrasts_in(table)
    strata = strata_in(table)
    levels = (
        table.filter(pl.col("ci_level").is_not_null())
        .group_by("ci_level")
        .agg(pl.col("estimand").unique())
    )
    main_level = (
        table.group_by("ci_level").len().sort("len", descending=True)["ci_level"].drop_nulls()
    )
    dropped = table.filter(pl.col("draws_dropped").fill_null(0) > 0)
    missing = table.filter(pl.col("value").is_null() | pl.col("value").is_nan())
    docs = table.filter((pl.col("estimand") == names[0]) & (pl.col("model") == models[0]))
    per_stratum = docs.group_by("stratum", maintain_order=True).agg(pl.col("n_docs").max())
    doc_text = ", ".join(
        f"{stratum_label(s)} {n}" for s, n in per_stratum.iter_rows() if n is not None
    )
    profile_text = "; ".join(
        f"{base}@{ats[0]}…{ats[-1]} ({len(ats)})" for base, ats in profiles.items()
    )
    facts = [
        f"{table.height:,} rows: {len(models)} model(s) ({', '.join(models)}) × "
        f"{len(actions)} action(s) ({', '.join(actions)}) and {len(contrasts)} contrast(s) "
        f"({', '.join(contrasts) or 'none'}) × {len(strata) + 1} strata (pooled and "
        f"{', '.join(stratum_label(s) for s in strata)}) × {len(names)} estimands: "
        f"{len(scalars)} scalars and the profiles {profile_text}.",
        f"Documents per stratum (model {models[0]}): {doc_text}.",
    ]
    if main_level.len():
        main = float(main_level[0])
        other = [
            f"{100 * float(level):.10g}% for {', '.join(sorted(set(est)))}"
            for level, est in levels.iter_rows()
            if float(level) != main
        ]
        facts.append(
            f"Intervals: document-bootstrap percentile intervals at {100 * main:.10g}%"
            + (f" ({'; '.join(other)}: the family-adjusted level)" if other else "")
            + "."
        )
    facts.append(
        f"Bootstrap draws left out (an undefined ratio in that draw): {dropped.height:,} rows, "
        f"at most {int(dropped['draws_dropped'].max()):,} draws per row."
        if dropped.height
        else "Bootstrap draws left out (an undefined ratio in that draw): none."
    )
    facts.append(
        f"Undefined values (NA): {missing.height:,} rows."
        if missing.height
        else "Undefined values (NA): none."
    )
    tables = [
        t
        for t in (
            _summary_table(
                table,
                "Pooled estimates per action",
                "Headline estimands, all strata pooled, per model and action "
                "(percent; B in percentage points; entry time in steps).",
                SUMMARY_ACTION_ESTIMANDS,
                "action",
            ),
            _summary_table(
                table,
                "Pooled contrasts",
                "Headline contrasts b − a, all strata pooled (percentage points; entry time in "
                "steps).",
                SUMMARY_CONTRAST_ESTIMANDS,
                "contrast",
            ),
        )
        if t is not None
    ]
    glossary = [(n, ESTIMAND_GLOSSARY.get(n, "")) for n in scalars]
    glossary += [(f"{base}@x", PROFILE_GLOSSARY.get(base, "")) for base in profiles]
    title = f"Estimands of {study}" if study else "Estimands"
    return EstimandsSummary(title, facts, tables, glossary)


_FILES_NOTE = (
    "Every row (per stratum too, and the profiles) is in `estimands.csv` (columns model, "
    "action, contrast, stratum, estimand, value, ci_low, ci_high, ci_level, n_docs, n_paths, "
    "draws_dropped; fractions) and in its typed copy `estimands.parquet` (action or contrast "
    "null where absent, `kind`, and a profile's name split into `estimand` and `at`/`index`)."
)


def render_summary_markdown(summary: EstimandsSummary) -> str:
    """The estimands summary as Markdown: facts, the two headline tables, the glossary."""
    lines = [f"# {summary.title}", "", _FILES_NOTE, ""]
    lines += [f"- {fact}" for fact in summary.facts]
    for table in summary.tables:
        lines += ["", f"## {table.name}", "", table.caption, ""]
        body = render_markdown(table).splitlines()[2:]  # without the caption paragraph
        lines += body
    lines += ["", "## Names in the file", "", "| Estimand | Meaning |", "|:---|:---|"]
    lines += [f"| `{name}` | {meaning} |" for name, meaning in summary.glossary]
    return "\n".join(lines) + "\n"


def render_summary_html(summary: EstimandsSummary) -> str:
    """The estimands summary as a self-contained HTML page."""
    body = [f"<h1>{escape(summary.title)}</h1>"]
    body.append(f"<p>{escape(_FILES_NOTE).replace('`', '')}</p><ul>")
    body += [f"<li>{_html_text(fact)}</li>" for fact in summary.facts]
    body.append("</ul>")
    for table in summary.tables:
        body += [f"<h2>{escape(table.name)}</h2>", f"<p>{_html_text(table.caption)}</p>"]
        body.append(_html_table(table, caption=False))
    body.append('<h2>Names in the file</h2><table class="study"><thead><tr>')
    body.append('<th class="key">Estimand</th><th class="key">Meaning</th></tr></thead><tbody>')
    for name, meaning in summary.glossary:
        cells = f'<td class="key"><code>{escape(name)}</code></td>'
        body.append(f'<tr>{cells}<td class="key">{_html_text(meaning)}</td></tr>')
    body.append("</tbody></table>")
    return html_document(summary.title, "\n".join(body))


def write_estimands_summary(
    estimands_csv: str | os.PathLike,
    parquet: str | os.PathLike,
    markdown: str | os.PathLike,
    html: str | os.PathLike,
    study: str = "",
) -> EstimandsSummary:
    """Write the tidy Parquet copy of ``estimands.csv`` and its summary (Markdown, HTML)."""
    table = read_estimands(estimands_csv)
    summary = estimands_summary(table, study, str(estimands_csv))
    tidy = tidy_estimands(table)
    with atomic_path(parquet, suffix=".parquet") as tmp:
        tidy.write_parquet(tmp)
    atomic_write_text(markdown, render_summary_markdown(summary))
    atomic_write_text(html, render_summary_html(summary))
    return summary
