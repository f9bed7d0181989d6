"""Tables 1–4 of the language-model study (SPEC §5, paper §5) as CSV, Markdown and LaTeX.

Every table is built from the long estimands table (DESIGN §3.4, ``estimands.csv``) and, for
Table 4, the prediction table (``prediction.csv``); nothing is recomputed. The CSV keeps the
values as fractions, exactly as read; the rendered tables show fractions as percent (contrasts
as percentage points), mean entry times in steps and counts as integers, with intervals as
``[lo, hi]`` and their level in the column header.

* Table 1 — timing and occupation per model × action, pooled: R_SMC, O_H, E_H, C_H, Π_H,
  E[τ | τ ≤ H], S_.99 and the branch-cohort support (documents / paths); SPEC §2, §5.
* Table 2 — gap decomposition per model × contrast, pooled: ΔR_SMC and its occurrence,
  exposure and rate terms, with their shares of ΔR_SMC; SPEC §2.
* Table 3 — the main contrast per model × stratum: ΔR_SMC, exposure term and share, the
  generation-clock change Δg, Δ(R − F), and each action's branch contrast B(a); SPEC §5.
* Table 4 — uncalibrated contrasts for the main contrast per model: full-H rollout-TV gap,
  fixed-history gap, positions 1–prefix flat-extrapolation gap, full − fixed, full − flat
  (from the estimands), then the development-selected predictions of that contrast (error with
  its interval and equivalence decision, document-contrast MAE and RMSE) where
  ``prediction.csv`` holds them; SPEC §5 "Aggregate prediction", "Uncalibrated contrasts".
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from kvdiverge.analysis.estimands import ESTIMAND_COLUMNS
from kvdiverge.analysis.prediction import PREDICTION_COLUMNS
from kvdiverge.io import atomic_path, atomic_write_text

__all__ = [
    "ESTIMAND_COLUMNS",
    "StudyTable",
    "StudyTableError",
    "Measure",
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
    "write_study_tables",
    "write_table",
]


class StudyTableError(ValueError):
    """An estimands or prediction table lacks what a figure or table needs (one-line message)."""


# ---------------------------------------------------------------------------------------------
# Reading and checking the analysis outputs
# ---------------------------------------------------------------------------------------------


def read_estimands(path: str | os.PathLike) -> pl.DataFrame:
    """Read ``estimands.csv`` (DESIGN §3.4); empty action/contrast cells become ``""``.

    A table written before the ``draws_dropped`` column existed reads with that column null
    (unknown), so its tables still render.

    Raises :class:`StudyTableError` naming the file when it is missing, lacks a column or
    holds no rows.
    """
    path = Path(path)
    if not path.is_file():
        raise StudyTableError(f"{path}: expected the estimands table (DESIGN §3.4), not found")
    table = pl.read_csv(path, infer_schema_length=None)
    if "draws_dropped" not in table.columns:  # written before the column existed: unknown
        table = table.with_columns(draws_dropped=pl.lit(None, dtype=pl.Int64))
    missing = [c for c in ESTIMAND_COLUMNS if c not in table.columns]
    if missing:
        raise StudyTableError(f"{path}: missing column(s) {', '.join(missing)} (DESIGN §3.4)")
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
    """The strata of ``table`` other than ``pooled`` (SPEC §5's env × length strata), in natural
    order (helmet-4k < helmet-16k < ruler-4k)."""
    found = {s for s in table["stratum"].unique().to_list() if s != "pooled"}
    return sorted(found, key=lambda s: _natural_key(s.lower().replace("k", "000")))


def stratum_label(stratum: str) -> str:
    """``helmet-4k`` → ``HELMET–4K``, the paper's labels of the SPEC §5 strata; ``pooled`` stays."""
    if stratum == "pooled":
        return "pooled"
    env, _, length = stratum.partition("-")
    return f"{env.upper()}–{length.upper()}" if length else env.upper()


def contrasts_in(table: pl.DataFrame) -> list[str]:
    """The contrast labels ``b - a`` (SPEC §2 gap decomposition, DESIGN §3.4) of ``table``, in
    order of first appearance."""
    return [c for c in table["contrast"].unique(maintain_order=True).to_list() if c]


def contrast_actions(contrast: str) -> tuple[str, str]:
    """``"b - a"`` → ``("b", "a")``: the actions of the contrast Δ = b − a (SPEC §2)."""
    b, sep, a = contrast.partition(" - ")
    if not sep or not b or not a:
        raise StudyTableError(f"contrast: expected a label 'b - a', got {contrast!r}")
    return b, a


def default_main_contrast(table: pl.DataFrame, where: str = "estimands") -> str:
    """The first contrast of the table (the first action pair of the study, SPEC §5)."""
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
    """Decimals that match the intervals: two significant digits of the median half-width in
    the display unit (a half-width of 3.2 points shows one decimal, of 12 none, of 0.4 two),
    between 0 and 3; ``default`` when no interval has a width."""
    shown = [abs(h) * _scale(unit) for h in half_widths if not _is_missing(h) and h != 0]
    if not shown:
        return default
    middle = float(np.median(shown))
    return min(3, max(0, 1 - math.floor(math.log10(middle))))


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
    """Table 1: timing and occupation per model × action, pooled (SPEC §2, §5).

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
    """Table 2: ΔR_SMC = occurrence + exposure + rate terms, with shares, pooled (SPEC §2)."""
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
    contrast (SPEC §5 "Divergence clock").
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
    """Table 4: uncalibrated contrasts of the main contrast, then its predictions (SPEC §5).

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


def _title(name: str) -> str:
    """``table3`` → ``Table 3``."""
    return re.sub(r"^table(\d+)$", r"Table \1", name)


def render_markdown(table: StudyTable) -> str:
    """A study table (SPEC §5) as GitHub-flavoured Markdown, its caption as a leading paragraph."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [f"**{_title(table.name)}.** {table.caption}", ""]
    lines.append("| " + " | ".join(cell(h) for h in table.header) + " |")
    n_text = table.group_columns + 1 if table.group_columns else 1
    rule = [":---" if i < n_text else "---:" for i in range(len(table.header))]
    lines.append("|" + "|".join(rule) + "|")
    for row in _grouped(table):
        lines.append("| " + " | ".join(cell(c) for c in row) + " |")
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
    "–": "--",
    "·": r"$\cdot$",
}
_LATEX_TOKEN_PATTERN = re.compile(
    "|".join(re.escape(t) for t in sorted(_LATEX_TOKENS, key=len, reverse=True))
)


_NEGATIVE = re.compile(r"(?<![\w$])-(?=\d)")  # the sign of a number, not a hyphen in a name


def latex_escape(text: str) -> str:
    """Escape LaTeX specials; typeset the estimand symbols of captions and headers as math."""
    parts, last = [], 0
    for match in _LATEX_TOKEN_PATTERN.finditer(text):
        parts.append("".join(_LATEX_SPECIAL.get(ch, ch) for ch in text[last : match.start()]))
        parts.append(_LATEX_TOKENS[match.group()])
        last = match.end()
    parts.append("".join(_LATEX_SPECIAL.get(ch, ch) for ch in text[last:]))
    return "".join(parts)


def render_latex(table: StudyTable, label: str | None = None) -> str:
    """A study table (SPEC §5) as a booktabs ``table`` environment (``\\toprule``,
    ``\\midrule``, ``\\bottomrule``; needs ``\\usepackage{booktabs}``).

    Text columns are left-aligned, numbers right-aligned with a true minus sign; a
    ``\\midrule`` separates groups.
    """
    n_text = table.group_columns + 1 if table.group_columns else 1
    align = "l" * n_text + "r" * (len(table.header) - n_text)
    lines = [
        r"\begin{table}[t]",
        r"\centering",
        r"\small",
        rf"\caption{{{latex_escape(table.caption)}}}",
        rf"\label{{{label or 'tab:' + table.name}}}",
        rf"\begin{{tabular}}{{{align}}}",
        r"\toprule",
        " & ".join(latex_escape(h) for h in table.header) + r" \\",
        r"\midrule",
    ]
    for i, row in enumerate(_grouped(table)):
        if i and table.group_columns and row[0]:
            lines.append(r"\midrule")
        cells = [_NEGATIVE.sub("$-$", latex_escape(c)) for c in row]
        lines.append(" & ".join(cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines) + "\n"


def write_table(
    table: StudyTable,
    csv: str | os.PathLike,
    markdown: str | os.PathLike,
    latex: str | os.PathLike,
) -> None:
    """Write a study table (SPEC §5): CSV (fractions), Markdown and LaTeX, each atomically."""
    with atomic_path(csv, suffix=".csv") as tmp:
        table.data.write_csv(tmp)
    atomic_write_text(markdown, render_markdown(table))
    atomic_write_text(latex, render_latex(table))


def write_study_tables(
    estimands_csv: str | os.PathLike,
    prediction_csv: str | os.PathLike | None,
    outputs: Mapping[str, tuple[str | os.PathLike, str | os.PathLike, str | os.PathLike]],
    actions: Sequence[str] | None = None,
    main_contrast: str | None = None,
) -> dict[str, StudyTable]:
    """Build Tables 1–4 of one study and write each as (CSV, Markdown, LaTeX) (SPEC §5).

    ``outputs`` maps ``table1``…``table4`` to their three paths. ``actions``: Table 1's rows
    (default: every action); ``main_contrast``: Tables 3–4's contrast (default: the first).
    Every input is read and every table built before anything is written.
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
