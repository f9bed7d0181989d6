"""The estimands' tidy typed copy (Parquet) and a one-page summary (Markdown and HTML) of
the estimands table."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

import polars as pl

from kvdiverge.analysis.bootstrap import MIN_INTERVAL_DOCUMENTS
from kvdiverge.analysis.estimand_registry import ESTIMANDS
from kvdiverge.io import atomic_path, atomic_write_text
from kvdiverge.tables.contrasts import GREEDY_NOTE
from kvdiverge.tables.inputs import (
    StudyTableError,
    actions_in,
    contrasts_in,
    models_in,
    read_estimands,
    strata_in,
    stratum_label,
)
from kvdiverge.tables.render import html_document, html_table, html_text, render_markdown
from kvdiverge.tables.study_table import (
    COUNT,
    NO_INTERVAL_NOTE,
    PERCENT,
    PP,
    STEPS,
    Cell,
    Column,
    StudyTable,
    decimals_for,
    format_value,
    half_width,
    interval_cell,
    level_text,
    unit_suffix,
)

ESTIMAND_GLOSSARY = {
    e.column: e.description
    for e in ESTIMANDS.values()
    if e.profile is None and e.computed_by != "accuracy"
}
"""One line per scalar estimand name of ``estimands.csv``, from the estimand registry
(:data:`kvdiverge.analysis.estimand_registry.ESTIMANDS`; the summary reads the registry itself,
so an estimand registered later is described too)."""
PROFILE_GLOSSARY = {e.column: e.description for e in ESTIMANDS.values() if e.profile}
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


def _description(name: str, default: str) -> str:
    """The registry's description of an estimand (a profile by its stem), else ``default``."""
    entry = ESTIMANDS.get(name)
    return default if entry is None else entry.description


def _summary_unit(estimand: str, contrast: bool) -> str:
    entry = ESTIMANDS.get(estimand)
    if estimand in _COUNT_ESTIMANDS or (entry is not None and entry.unit == "count"):
        return COUNT
    if entry is not None and entry.unit == "steps":
        return STEPS
    if contrast or estimand.endswith("contrast_B"):
        return PP
    return PERCENT


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
    columns_of = actions_in(table) if by == "action" else contrasts_in(table)
    if not columns_of:
        return None
    present = set(table["estimand"].unique().to_list())
    estimands = [e for e in estimands if e in present]
    pooled = table.filter(
        (pl.col("stratum") == "pooled") & pl.col("estimand").is_in(estimands) & (pl.col(by) != "")
    )
    rows, records = [], []
    absent = False
    for model in models_in(table):
        for estimand in estimands:
            cells = pooled.filter((pl.col("model") == model) & (pl.col("estimand") == estimand))
            by_key = {r[by]: r for r in cells.iter_rows(named=True)}
            unit = _summary_unit(estimand, by == "contrast")
            widths = [half_width(r["ci_low"], r["ci_high"]) for r in by_key.values()]
            digits = decimals_for(widths, unit)
            label = f"{estimand}: {_description(estimand, estimand)}{unit_suffix(unit)}"
            row: list[str] = [model, label]
            for key in columns_of:
                r = by_key.get(key)
                if r is None:
                    row.append(Cell(""))
                elif unit == COUNT:
                    row.append(Cell(format_value(r["value"], COUNT)))
                else:
                    n = r["n_docs"]
                    row.append(
                        interval_cell(r["value"], r["ci_low"], r["ci_high"], unit, digits, n)
                    )
                    absent |= n < MIN_INTERVAL_DOCUMENTS
                if r is not None:
                    records.append({"model": model, by: key, "estimand": estimand})
            rows.append(row)
    level = level_text(pooled["ci_level"].to_list())
    columns = (Column("Model"), Column("Estimand"), *(Column(c, level=level) for c in columns_of))
    header = [c.header for c in columns]
    data = pl.DataFrame(records, schema={"model": pl.String, by: pl.String, "estimand": pl.String})
    notes = (NO_INTERVAL_NOTE,) if absent else ()
    return StudyTable(
        name, caption, data, header, rows, group_columns=1, columns=columns, notes=notes
    )


@dataclass(frozen=True)
class EstimandsSummary:
    """A short account of ``estimands.csv``: what it holds (``facts``), two tables of pooled
    headline estimates (per action, per contrast) and the glossary of every name it holds."""

    title: str
    facts: list[str]
    tables: list[StudyTable]
    glossary: list[tuple[str, str]]


def estimands_summary(
    table: pl.DataFrame, study: str = "", where: str = "estimands", temperature: float | None = None
) -> EstimandsSummary:
    """Summarize the estimands table (as :func:`read_estimands` returns it) in a page.

    ``temperature``: the rollouts' decoding temperature, where known; at 0 (greedy) the page
    states once the identities that hold then (:data:`kvdiverge.tables.contrasts.GREEDY_NOTE`:
    S_.99 = R = R_SMC, one path per document, K = 1)."""
    if table.height == 0:
        raise StudyTableError(f"{where}: expected estimand rows, found none")
    names = table["estimand"].unique(maintain_order=True).to_list()
    scalars = [n for n in names if "@" not in n]
    profiles: dict[str, list[str]] = {}
    for n in names:
        if "@" in n:
            base, _, at = n.partition("@")
            profiles.setdefault(base, []).append(at)
    models, actions, contrasts = models_in(table), actions_in(table), contrasts_in(table)
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
    alone = table.filter(pl.col("n_docs") < MIN_INTERVAL_DOCUMENTS)
    alone_strata = sorted(set(alone["stratum"].to_list()))
    facts.append(
        f"Intervals not available (the row rests on fewer than two documents): "
        f"{alone.height:,} rows ({', '.join(stratum_label(s) for s in alone_strata)})."
        if alone.height
        else "Intervals not available (fewer than two documents): none."
    )
    facts.append(
        f"Undefined values (NA): {missing.height:,} rows."
        if missing.height
        else "Undefined values (NA): none."
    )
    if temperature == 0:
        facts.append(GREEDY_NOTE)
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
    glossary = [(n, _description(n, "")) for n in scalars]
    glossary += [(f"{base}@x", _description(base, "")) for base in profiles]
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
    body += [f"<li>{html_text(fact)}</li>" for fact in summary.facts]
    body.append("</ul>")
    for table in summary.tables:
        body += [f"<h2>{escape(table.name)}</h2>", f"<p>{html_text(table.caption)}</p>"]
        body.append(html_table(table, caption=False))
    body.append('<h2>Names in the file</h2><table class="study"><thead><tr>')
    body.append('<th class="key">Estimand</th><th class="key">Meaning</th></tr></thead><tbody>')
    for name, meaning in summary.glossary:
        cells = f'<td class="key"><code>{escape(name)}</code></td>'
        body.append(f'<tr>{cells}<td class="key">{html_text(meaning)}</td></tr>')
    body.append("</tbody></table>")
    return html_document(summary.title, "\n".join(body))


def write_estimands_summary(
    estimands_csv: str | os.PathLike,
    parquet: str | os.PathLike,
    markdown: str | os.PathLike,
    html: str | os.PathLike,
    study: str = "",
    registration: str | None = None,
    temperature: float | None = None,
) -> EstimandsSummary:
    """Write the tidy Parquet copy of ``estimands.csv`` and its summary (Markdown, HTML);
    ``registration``: the lock registration the estimands come from, the summary's first
    fact; ``temperature``: the rollouts' (:func:`estimands_summary`)."""
    table = read_estimands(estimands_csv)
    summary = estimands_summary(table, study, str(estimands_csv), temperature)
    if registration:
        summary.facts.insert(0, registration)
    tidy = tidy_estimands(table)
    with atomic_path(parquet, suffix=".parquet") as tmp:
        tidy.write_parquet(tmp)
    atomic_write_text(markdown, render_summary_markdown(summary))
    atomic_write_text(html, render_summary_html(summary))
    return summary
