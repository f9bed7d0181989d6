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

Modules: :mod:`~kvdiverge.tables.inputs` (reading and checking the analysis outputs),
:mod:`~kvdiverge.tables.study_table` (a table's measures, cells and number formats),
:mod:`~kvdiverge.tables.paper` (Tables 1–4), :mod:`~kvdiverge.tables.render` (Markdown,
LaTeX, HTML), :mod:`~kvdiverge.tables.accuracy` (Table A) and
:mod:`~kvdiverge.tables.summary` (the tidy estimands and their summary). This package gathers
their public names.

Also: :mod:`kvdiverge.tables.generations` (generations side by side),
:mod:`kvdiverge.tables.headline` (each action's divergence and accuracy side by side),
:mod:`kvdiverge.tables.landing` (a study's part of the report's landing page) and
:mod:`kvdiverge.tables.metrics` (``metrics.json``).
"""

from kvdiverge.analysis.estimands import ESTIMAND_COLUMNS
from kvdiverge.tables.accuracy import accuracy_study_table, write_accuracy_table
from kvdiverge.tables.inputs import (
    StudyTableError,
    contrast_actions,
    contrasts_in,
    default_main_contrast,
    read_estimands,
    read_prediction,
    require_estimands,
    strata_in,
    stratum_label,
)
from kvdiverge.tables.paper import (
    table1_timing,
    table2_decomposition,
    table3_strata,
    table4_uncalibrated,
    write_study_tables,
)
from kvdiverge.tables.render import (
    MAX_LATEX_COLUMNS,
    html_document,
    latex_escape,
    latex_panels,
    render_html,
    render_latex,
    render_markdown,
    write_table,
)
from kvdiverge.tables.study_table import (
    HIDDEN,
    SHARE_NOTE,
    Measure,
    StudyTable,
    covers_zero,
    decimals_for,
    format_interval,
    format_value,
)
from kvdiverge.tables.summary import (
    ESTIMAND_GLOSSARY,
    EstimandsSummary,
    estimands_summary,
    render_summary_html,
    render_summary_markdown,
    tidy_estimands,
    write_estimands_summary,
)

__all__ = [
    "ESTIMAND_COLUMNS",
    "ESTIMAND_GLOSSARY",
    "EstimandsSummary",
    "HIDDEN",
    "MAX_LATEX_COLUMNS",
    "Measure",
    "SHARE_NOTE",
    "StudyTable",
    "StudyTableError",
    "accuracy_study_table",
    "covers_zero",
    "contrast_actions",
    "contrasts_in",
    "decimals_for",
    "default_main_contrast",
    "estimands_summary",
    "format_interval",
    "format_value",
    "html_document",
    "latex_escape",
    "latex_panels",
    "read_estimands",
    "read_prediction",
    "render_html",
    "render_latex",
    "render_markdown",
    "render_summary_html",
    "render_summary_markdown",
    "require_estimands",
    "strata_in",
    "stratum_label",
    "table1_timing",
    "table2_decomposition",
    "table3_strata",
    "table4_uncalibrated",
    "tidy_estimands",
    "write_accuracy_table",
    "write_estimands_summary",
    "write_study_tables",
    "write_table",
]
