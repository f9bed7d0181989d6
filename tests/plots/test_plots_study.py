"""Study figures 5–7, decomposition bars and figure 1, plus the Snakemake rules that draw them
and the tables from a synthetic study's estimands."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import polars as pl
import pytest
from study_helpers import CONTROL, LAMBDAS, STUDY2_LAMBDAS, build_lock, build_study
from workflow_helpers import planned_jobs, run_snakemake, workflow_copy

from kvdiverge.analysis.document_stats import Clock
from kvdiverge.plots.base import CONTROL_STYLE
from kvdiverge.plots.study import (
    FIGURES,
    action_styles,
    branch_windows,
    plot_branch_endpoints,
    profile,
    write_study_figures,
)
from kvdiverge.plots.theory import introductory_curves, write_introductory_figure
from kvdiverge.tables import StudyTableError, read_estimands

ROOT = Path(__file__).resolve().parents[2]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
COMPARED = [a for a in LAMBDAS if a != CONTROL]
ALL_ACTIONS = ["full", "snapkv-512", "snapkv-half", "recent-half", "snapkv-90", "recent-90"]
H = 32


@pytest.fixture(scope="module")
def study2(tmp_path_factory):
    """Study-2-like: two compared actions, family-adjusted S_99 and B (m = 8)."""
    root = tmp_path_factory.mktemp("study2")
    est, _ = build_study(root, STUDY2_LAMBDAS, family_size=8, pair=None)
    return est, read_estimands(est)


@pytest.fixture(scope="module")
def study1(tmp_path_factory):
    root = tmp_path_factory.mktemp("study1")
    est, pred = build_study(root)
    return est, pred, read_estimands(est)


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _is_pdf(path: Path) -> bool:
    return path.read_bytes()[:5] == b"%PDF-"


def test_every_study_figure_is_written_as_png_and_pdf(study1, tmp_path):
    est, _, _ = study1
    outputs = {n: (tmp_path / f"{n}.png", tmp_path / f"{n}.pdf") for n in FIGURES}
    open_before = plt.get_fignums()  # another test in this worker may have left one open
    write_study_figures(est, outputs, COMPARED, ALL_ACTIONS, CONTROL)
    for png, pdf in outputs.values():
        assert _is_png(png) and png.stat().st_size > 20_000, png
        assert _is_pdf(pdf) and pdf.stat().st_size > 5_000, pdf
    assert plt.get_fignums() == open_before  # every figure it drew closed


def test_profiles_come_from_the_table(study1):
    _, _, table = study1
    cdf = profile(table, "div_cdf")
    assert sorted(set(cdf["x"].to_list())) == list(range(1, H + 1))
    tv = profile(table, "tv")
    assert set(tv["estimand"].str.split("@").list.get(0)) == {"tv"}  # not block_tv / branch_tv
    assert tv["x"].max() == H


def test_branch_windows_recover_the_clock(study1):
    _, _, table = study1
    clock = Clock.for_horizon(H)
    early, late = branch_windows(table)
    d, w = clock.branch_depth, clock.window
    assert (early, late) == (range(1, w + 1), range(d - w + 1, d + 1))


def test_branch_windows_reject_inconsistent_tables(study1):
    _, _, table = study1
    broken = table.with_columns(
        value=pl.when(pl.col("estimand") == "branch_early")
        .then(pl.col("value") + 0.1)
        .otherwise(pl.col("value"))
    )
    with pytest.raises(StudyTableError, match="not window means"):
        branch_windows(broken, "x.csv")


def test_styles_are_stable_distinct_and_grey_the_control():
    s1 = action_styles(ALL_ACTIONS, control="full")
    assert s1 == action_styles(ALL_ACTIONS, control="full")
    assert s1["full"] == CONTROL_STYLE
    compared = [s1[a] for a in ALL_ACTIONS if a != "full"]
    assert len({s.color for s in compared}) == len(compared)
    assert len({str(s.linestyle) for s in compared}) == len(compared)
    assert CONTROL_STYLE.color not in {s.color for s in compared}
    # a study's first two actions are the high-contrast blue/vermillion pair (study 2's two)
    s2 = action_styles(["snapkv-90", "recent-90", "full"], control="full")
    assert (s2["snapkv-90"].color, s2["recent-90"].color) == ("#0072B2", "#D55E00")
    assert s2["snapkv-90"].linestyle != s2["recent-90"].linestyle


def test_figure7_shows_the_family_level(study2):
    _, table = study2
    levels = table.filter(
        (pl.col("stratum") == "pooled")
        & pl.col("action").is_in(["snapkv-90", "recent-90"])
        & pl.col("estimand").is_in(["S_99", "branch_contrast_B"])
    )["ci_level"]
    assert np.allclose(levels, 1 - 0.05 / 8)
    fig = plot_branch_endpoints(table, ["snapkv-90", "recent-90"])
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    plt.close(fig)
    assert all("99.375%" in t for t in titles), titles


def test_missing_estimand_names_it_and_the_file_and_writes_nothing(study1, tmp_path):
    _, _, table = study1
    broken = tmp_path / "estimands.csv"
    table.filter(~pl.col("estimand").str.starts_with("div_cdf@")).write_csv(broken)
    outputs = {n: (tmp_path / "out" / f"{n}.png", tmp_path / "out" / f"{n}.pdf") for n in FIGURES}
    with pytest.raises(StudyTableError) as err:
        write_study_figures(broken, outputs, COMPARED)
    assert str(err.value) == f"{broken}: estimand 'div_cdf@1' missing (needed by figure 5)"
    assert not (tmp_path / "out").exists()
    no_s99 = tmp_path / "no_s99.csv"
    table.filter(pl.col("estimand") != "S_99").write_csv(no_s99)
    with pytest.raises(StudyTableError, match=r"estimand 'S_99' missing \(needed by figure 7\)"):
        write_study_figures(no_s99, {"fig7_branch_contrasts": outputs["decomposition"]})
    with pytest.raises(StudyTableError, match="no rows for action 'recent-90'"):
        write_study_figures(no_s99, {"decomposition": outputs["decomposition"]}, ["recent-90"])


@pytest.mark.parametrize(("eps", "horizon"), [(0.2, 32), (0.5, 4)])
def test_introductory_example_curves_are_exact(eps, horizon):
    curves = introductory_curves(eps, horizon)
    revert, persist = curves["revert"], curves["persist"]
    np.testing.assert_allclose(revert["mismatch"], [eps] + [0.0] * (horizon - 1), atol=1e-15)
    np.testing.assert_allclose(persist["mismatch"], [eps] * horizon, atol=1e-15)
    np.testing.assert_allclose(revert["div_cdf"], persist["div_cdf"], atol=0)
    np.testing.assert_allclose(revert["div_cdf"], eps, atol=1e-15)
    assert revert["sequence_tv"] == pytest.approx(eps, abs=1e-15)
    assert persist["sequence_tv"] == pytest.approx(eps, abs=1e-15)
    assert revert["R_SMC"] == pytest.approx(eps / horizon, abs=1e-15)
    assert persist["R_SMC"] == pytest.approx(eps, abs=1e-15)
    for c in (revert, persist):
        assert c["O_H"] == pytest.approx(eps / horizon, abs=1e-15)
        assert c["O_H"] + c["Pi_H"] == pytest.approx(c["R_SMC"], abs=1e-15)
        assert c["mismatch"].mean() == pytest.approx(c["R_SMC"], abs=1e-15)


def test_introductory_figure_is_written(tmp_path):
    png, pdf = tmp_path / "fig1.png", tmp_path / "fig1.pdf"
    write_introductory_figure(0.25, 16, png, pdf)
    assert _is_png(png) and png.stat().st_size > 20_000
    assert _is_pdf(pdf)


# ---- the Snakemake rules ---------------------------------------------------------------------

MY_RULES = ["introductory_figure", "study_figures", "study_branch_figure", "study_tables"]


@pytest.mark.slow
def test_rules_draw_every_figure_and_table_from_placed_estimands(tmp_path, study1, study2):
    work = workflow_copy(tmp_path)
    est1, pred1, _ = study1
    est2, _ = study2
    for study, files in (("study1", (est1, pred1)), ("study2", (est2,))):
        folder = work / "results" / study / "tables"
        folder.mkdir(parents=True)
        for f in files:
            shutil.copy(f, folder / f.name)
        build_lock(work / "results" / study, study)
    fig1 = [f"results/theory/figures/fig1_introductory_example.{e}" for e in ("png", "pdf")]
    figures = {
        study: [
            f"results/{study}/figures/{n}.{e}"
            for n in [
                "fig5_divergence_cdf",
                "fig5_divergence_cdf_strata",
                "fig6_tv_profiles",
                "decomposition",
            ]
            + (["fig7_branch_contrasts"] if study == "study2" else [])
            for e in ("png", "pdf")
        ]
        for study in ("study1", "study2")
    }
    tables = {
        study: [
            f"results/{study}/tables/table{i}.{e}"
            for i in range(1, 5)
            for e in ("csv", "md", "tex", "html")
        ]
        + [
            f"results/{study}/tables/{name}"
            for name in ("estimands.parquet", "estimands_summary.md", "estimands_summary.html")
        ]
        for study in ("study1", "study2")
    }
    targets = fig1 + figures["study1"] + figures["study2"] + tables["study1"] + tables["study2"]
    allowed = ["--allowed-rules", *MY_RULES]
    # only the four rendering rules would run: the placed analysis tables are taken as they are
    dry = run_snakemake(work, "-n", *targets, *allowed)
    assert dry.returncode == 0, dry.stdout[-3000:] + dry.stderr[-3000:]
    assert planned_jobs(dry) == {
        "introductory_figure": 1,
        "study_branch_figure": 1,
        "study_figures": 2,
        "study_tables": 2,
    }
    res = run_snakemake(work, *targets, *allowed)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for path in targets:
        assert (work / path).stat().st_size > 300, path
    for study in ("study1", "study2"):
        assert _is_png(work / figures[study][0])
        table1 = pl.read_csv(work / f"results/{study}/tables/table1.csv")
        compared = [a for a in (LAMBDAS if study == "study1" else STUDY2_LAMBDAS) if a != CONTROL]
        assert table1["action"].to_list() == compared * 2  # the control is left out
    # study 2: no prediction pair, so no prediction rows; main contrast = its first contrast
    t4 = pl.read_csv(work / "results/study2/tables/table4.csv")
    assert set(t4["section"]) == {"uncalibrated"}
    assert (
        "snapkv-90 - recent-90 per stratum"
        in (work / "results/study2/tables/table3.md").read_text()
    )
    # study 1: prediction rows of its prediction pair
    t4 = pl.read_csv(work / "results/study1/tables/table4.csv")
    assert set(t4["section"]) == {"uncalibrated", "prediction"}
    assert not (work / "results/study1/figures/fig7_branch_contrasts.png").exists()
    for rule in MY_RULES:
        assert list((work / "results/benchmarks" / rule).glob("*.tsv")), rule
    log = (work / "results/logs/figures/introductory_figure.log").read_text()
    assert "persist: R_SMC=0.2 " in log
    again = run_snakemake(work, "-n", *targets, *allowed)
    assert "Nothing to be done" in again.stdout + again.stderr
    # figure 7 is only for studies with a prespecified family
    missing = run_snakemake(
        work, "-n", "results/study1/figures/fig7_branch_contrasts.png", *allowed
    )
    assert missing.returncode != 0


@pytest.mark.slow
def test_main_contrast_must_be_a_contrast_of_the_study(tmp_path):
    work = workflow_copy(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("figures:\n  main_contrast: {study2: [snapkv-90, recent-90]}\n")
    target = "results/study2/tables/table3.csv"
    res = run_snakemake(work, "-n", target, "--configfile", str(bad))
    assert res.returncode != 0
    assert (
        "config.figures.main_contrast.study2: expected one of the study's contrasts "
        "[['recent-90', 'snapkv-90']] (config.analysis.contrasts), got ['snapkv-90', 'recent-90']"
    ) in res.stdout + res.stderr
