"""No interval where none exists (issue 28 item 5): a row resting on one document (a cohort or
stratum of one) gets no interval, and every table says "not available" with the reason; the
per-stratum table gives each row's documents."""

from __future__ import annotations

import numpy as np
import polars as pl

from kvdiverge.analysis.bootstrap import distinct_resamples
from kvdiverge.analysis.document_stats import document_stats
from kvdiverge.analysis.estimands import estimands_table, render_markdown, write_estimands
from kvdiverge.analysis.synthetic import stratum_pairs, write_synthetic_study
from kvdiverge.tables import read_estimands
from kvdiverge.tables.paper import table3_strata, write_study_tables
from kvdiverge.tables.render import render_html
from kvdiverge.tables.study_table import NO_INTERVAL_NOTE

LAMBDAS = {"full": 0.0, "snapkv-half": 0.3, "recent-half": 0.6}
STRATA = ["helmet-1024", "ruler-1024"]


def _estimands(tmp_path) -> pl.DataFrame:
    pairs = {s: stratum_pairs(7 + i, LAMBDAS) for i, s in enumerate(STRATA)}
    files = write_synthetic_study(
        tmp_path, "study2", "m", pairs, {"dev": (2, 2), "study2": (1, 3)}, H=16, seed=3,
        control="full",
    )  # fmt: skip
    stats, clock = document_stats(
        {a: list(files[a].values()) for a in LAMBDAS},
        list(files["documents"].values()),
        control="full",
    )
    return estimands_table(
        stats, clock, model="m", actions=list(LAMBDAS), control="full", cohort="study2",
        draws=50, seed=1,
    )  # fmt: skip


def test_a_stratum_of_one_document_has_no_interval_in_any_table(tmp_path):
    table = _estimands(tmp_path)
    one = table.filter(pl.col("stratum") != "pooled")
    assert (one["n_docs"] == 1).all()
    assert one["ci_low"].is_nan().all() and one["ci_high"].is_nan().all()
    pooled = table.filter((pl.col("stratum") == "pooled") & (pl.col("estimand") == "R_smc"))
    assert (pooled["n_docs"] == 2).all() and pooled["ci_low"].is_finite().all()
    # the Markdown of estimands.csv
    markdown = render_markdown(table)
    row = next(line for line in markdown.splitlines() if "| ruler-1024 | R_smc |" in line)
    assert "| not available (1 document) |" in row
    # Table 3 (per stratum): the documents of each row, "not available" with the reason
    csv, md = tmp_path / "estimands.csv", tmp_path / "estimands.md"
    write_estimands(table, str(csv), str(md))
    t3 = table3_strata(read_estimands(csv), "snapkv-half - recent-half")
    by_stratum = {row[1]: row for row in t3.rows}
    assert by_stratum["ruler-1024"][2] == "1" and by_stratum["pooled"][2] == "2"
    assert by_stratum["ruler-1024"][3].endswith(" [not available: 1 document]")
    assert "[" in by_stratum["pooled"][3] and "not available" not in by_stratum["pooled"][3]
    assert NO_INTERVAL_NOTE in t3.notes
    assert "not available: 1 document" in render_html(t3)
    print(t3.header)
    print(by_stratum["ruler-1024"])  # the closing note's example row


def test_the_tables_say_which_registration_they_come_from(tmp_path):
    table = _estimands(tmp_path)
    csv = tmp_path / "estimands.csv"
    write_estimands(table, str(csv), str(tmp_path / "estimands.md"))
    line = "Registration 2 of study2 (lock abc; 1 earlier registration; a reason)."
    outputs = {
        name: tuple(tmp_path / f"{name}.{ext}" for ext in ("csv", "md", "tex", "html"))
        for name in ("table1", "table3")
    }
    built = write_study_tables(
        csv, None, outputs, main_contrast="snapkv-half - recent-half", registration=line
    )
    for name in outputs:
        assert built[name].notes[-1] == line
        assert line in (tmp_path / f"{name}.md").read_text()


def test_distinct_resamples():
    assert distinct_resamples([1]) == 1
    assert distinct_resamples([3]) == 10
    assert distinct_resamples([3, 2]) == 30
    assert np.isclose(distinct_resamples([8]), 6435)


def test_figures_say_the_interval_is_not_available(tmp_path):
    from kvdiverge.plots.study import plot_divergence_cdf, plot_divergence_cdf_strata

    csv = tmp_path / "estimands.csv"
    write_estimands(_estimands(tmp_path), str(csv), str(tmp_path / "estimands.md"))
    table = read_estimands(csv)
    strata = plot_divergence_cdf_strata(table, ["snapkv-half", "recent-half"])
    texts = [t.get_text() for ax in strata.axes for t in ax.texts]
    assert texts.count("interval not available: 1 document") == len(STRATA)
    pooled = plot_divergence_cdf(table, ["snapkv-half", "recent-half"])  # 2 documents
    assert not any("not available" in t.get_text() for ax in pooled.axes for t in ax.texts)
