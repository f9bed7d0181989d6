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


def _branch_cohort_of_one(tmp_path) -> tuple[pl.DataFrame, object]:
    """Study-2 statistics of 3 + 3 documents in which recent-half's branch cohort holds one
    document (every other document's branch statistics set to 0: it never branched early)."""
    pairs = {s: stratum_pairs(7 + i, LAMBDAS) for i, s in enumerate(STRATA)}
    files = write_synthetic_study(
        tmp_path, "study2", "m", pairs, {"dev": (2, 2), "study2": (3, 4)}, H=16, seed=3,
        control="full",
    )  # fmt: skip
    stats, clock = document_stats(
        {a: list(files[a].values()) for a in LAMBDAS},
        list(files["documents"].values()),
        control="full",
    )
    branch = [c for c in stats.columns if c.startswith("branch") or c == "cohort_paths"]
    rows = stats.filter(action="recent-half", cohort="study2").sort("doc_id")
    carrier = rows.filter(pl.col("branch_cohort") > 0)["doc_id"][0]
    cleared = (pl.col("action") == "recent-half") & (pl.col("doc_id") != carrier)
    stats = stats.with_columns(
        [pl.when(cleared).then(0.0).otherwise(pl.col(c)).cast(stats[c].dtype).alias(c)
         for c in branch]
    )  # fmt: skip
    return stats, clock


def test_a_ratio_whose_denominator_one_document_carries_has_no_interval(tmp_path):
    stats, clock = _branch_cohort_of_one(tmp_path)
    evaluation = stats.filter(cohort="study2")
    # independently of the code under test: documents whose branch cohort is not empty
    carriers = evaluation.filter(pl.col("branch_cohort") > 0).group_by("action").len()
    counts = dict(zip(carriers["action"], carriers["len"], strict=True))
    assert counts["recent-half"] == 1 and counts["snapkv-half"] >= 2
    table = estimands_table(
        stats, clock, model="m", actions=list(LAMBDAS), control="full", cohort="study2",
        draws=2000, seed=1, family_estimands=["branch_contrast_B"], family_size=8,
    )  # fmt: skip
    pooled = table.filter(stratum="pooled")
    b_recent = pooled.filter(action="recent-half", estimand="branch_contrast_B").row(0, named=True)
    assert b_recent["n_docs"] == 6 and b_recent["denominator_docs"] == 1
    assert np.isfinite(b_recent["value"]) and np.isnan(b_recent["ci_low"])
    b_snap = pooled.filter(action="snapkv-half", estimand="branch_contrast_B").row(0, named=True)
    assert b_snap["denominator_docs"] == counts["snapkv-half"]
    assert b_snap["ci_low"] <= b_snap["value"] <= b_snap["ci_high"]
    # a contrast of the ratio rests on the fewer carriers of its two actions
    contrast = pooled.filter(contrast="snapkv-half - recent-half", estimand="branch_contrast_B")
    assert contrast["denominator_docs"].to_list() == [1] and contrast["ci_low"].is_nan().all()
    # a mean estimand rests on every document, and the table says its draws
    r_smc = pooled.filter(action="recent-half", estimand="R_smc").row(0, named=True)
    assert r_smc["denominator_docs"] == 6 and np.isfinite(r_smc["ci_low"])
    assert (table["draws"] == 2000).all()
    markdown = render_markdown(table)
    assert markdown.splitlines()[0].startswith(
        "Intervals: percentile bootstrap over documents, 2,000 draws"
    )
    row = next(
        line
        for line in markdown.splitlines()
        if "| recent-half |  | pooled | branch_contrast_B |" in line
    )
    assert "not available (1 of 6 documents carry the denominator)" in row
    print(row)  # the closing note's example row


def test_too_few_bootstrap_draws_for_a_level_are_refused_at_config_time():
    from kvdiverge.analysis.bootstrap import bootstrap_draws_problem, min_draws

    # B·(1 − L)/2 >= 50 draws in each tail, checked against the definition
    for level in (0.9, 0.95, 0.99, 1 - 0.05 / 8):
        b = min_draws(level)
        assert b * (1 - level) / 2 >= 50 - 1e-6 and (b - 1) * (1 - level) / 2 < 50
    assert (min_draws(0.95), min_draws(1 - 0.05 / 8)) == (2000, 16000)
    config = {
        "analysis": {"level": 0.95, "alpha": 0.05},
        "studies": {
            "study1": {"bootstrap_draws": 2000},
            "study2": {"bootstrap_draws": 10000, "family_endpoints": 8},
        },
    }
    assert bootstrap_draws_problem(config) == (
        "config.studies.study2.bootstrap_draws: 10000 draws put 31.2 in each tail of its "
        "99.375% intervals; expected at least 16000 (>= 50 draws in each tail)"
    )
    config["studies"]["study2"]["bootstrap_draws"] = 16000
    assert bootstrap_draws_problem(config) is None
    config["studies"]["study1"]["bootstrap_draws"] = 1999
    assert "config.studies.study1.bootstrap_draws: 1999 draws" in bootstrap_draws_problem(config)


def test_the_study_tables_say_the_draws(tmp_path):
    from kvdiverge.analysis.estimands import draws_line

    csv = tmp_path / "estimands.csv"
    write_estimands(_estimands(tmp_path), str(csv), str(tmp_path / "estimands.md"))
    assert draws_line(str(csv)) == "Intervals: percentile bootstrap over documents, 50 draws."
    old = tmp_path / "old.csv"
    pl.read_csv(csv).drop("draws").write_csv(old)
    assert draws_line(str(old)) == ""  # written before the column existed: said nowhere
