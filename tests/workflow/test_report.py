"""The structure of `snakemake --report`: every entry in a named category and subcategory with
its caption, every figure once and as PNG (no PDF entries), every table as its HTML rendering,
CSV only as downloadable data. Built from placed analysis tables (a synthetic study's
estimands and prediction, and the accuracy rule's outputs from synthetic accuracy statistics)
and a small finite-state study, so that only the rendering rules run."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from study_helpers import STUDY2_LAMBDAS, build_accuracy, build_lock, build_study
from workflow_helpers import run_snakemake, workflow_copy

TARGETS = [
    "results/theory/figures/fig1_introductory_example.png",
    "results/finite_state/figures/estimators.png",
    "results/finite_state/systems.csv",
    "results/study1/tables/table1.html",
    "results/study2/tables/table1.html",
    "results/study1/figures/fig5_divergence_cdf.png",
    "results/study2/figures/fig5_divergence_cdf.png",
    "results/study2/figures/fig7_branch_contrasts.png",
]
# placed (synthetic accuracy statistics), not built: the accuracy rule needs trajectories
ACCURACY = [
    f"results/{s}/{f}"
    for s in ("study1", "study2")
    for f in ("tables/table_accuracy.html", "figures/accuracy.png")
]
RULES = [
    "introductory_figure",
    "study_figures",
    "study_branch_figure",
    "study_tables",
    "finite_state_systems",
    "finite_state_figures",
]
STUDY_FIGURES = [
    "fig5_divergence_cdf",
    "fig5_divergence_cdf_strata",
    "fig6_tv_profiles",
    "decomposition",
]


def report_entries(html: str) -> tuple[dict, dict]:
    """``(categories, results)`` embedded in a Snakemake report: categories map a category to
    its subcategories and their result paths; results map a path to its record (``mime_type``,
    ``caption``, ``labels``...)."""
    decoder = json.JSONDecoder()
    categories, _ = decoder.raw_decode(html, html.index("var categories = ") + 17)
    start = html.index("var results = {") + len("var results = ")
    results, _ = decoder.raw_decode(html, start)
    return categories, results


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    work = workflow_copy(root)
    (root / "s1").mkdir()
    (root / "s2").mkdir()
    est1, pred1 = build_study(root / "s1")
    est2, _ = build_study(root / "s2", STUDY2_LAMBDAS, family_size=8, pair=None)
    for study, files in (("study1", (est1, pred1)), ("study2", (est2,))):
        folder = work / "results" / study / "tables"
        folder.mkdir(parents=True)
        for f in files:
            shutil.copy(f, folder / f.name)
        build_lock(work / "results" / study, study)
    build_accuracy(work / "results" / "study1")
    build_accuracy(work / "results" / "study2", STUDY2_LAMBDAS)
    small = root / "small.yaml"
    small.write_text("finite_state: {n_systems: 5, n_reps: 400, interval_figure_systems: [0, 4]}\n")
    config = ["--configfile", str(small)]
    res = run_snakemake(work, *TARGETS, "--allowed-rules", *RULES, *config)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    res = run_snakemake(work, *TARGETS, *ACCURACY, *config, "--report", "report.html")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    html = (work / "report.html").read_text(errors="replace")
    return work, *report_entries(html)


@pytest.mark.slow
def test_every_entry_sits_in_a_named_category_with_a_caption(report):
    _, categories, results = report
    assert set(categories) == {"Theory", "Finite-state study", "Language-model study"}
    for category, subcategories in categories.items():
        assert "Other" not in subcategories, category
        assert all(subcategories.values()), category
    assert set(categories["Language-model study"]) == {
        "Figures",
        "Appendix figures",
        "Tables",
        "Estimands",
        "Data",
    }
    listed = [p for subs in categories.values() for paths in subs.values() for p in paths]
    assert sorted(listed) == sorted(results)  # every result in exactly one place
    for path, record in results.items():
        assert record["caption"].strip(), path


@pytest.mark.slow
def test_figures_appear_once_as_png(report):
    _, _, results = report
    mimes = Counter(record["mime_type"] for record in results.values())
    assert "application/pdf" not in mimes
    figures = [p for p, r in results.items() if r["mime_type"].startswith("image/")]
    assert all(p.endswith(".png") for p in figures)
    stems = Counter(Path(p).with_suffix("").as_posix() for p in figures)
    assert max(stems.values()) == 1  # each figure once
    expected = {
        f"results/{s}/figures/{n}"
        for s in ("study1", "study2")
        for n in [*STUDY_FIGURES, "accuracy"]
    }
    expected |= {
        "results/study2/figures/fig7_branch_contrasts",
        "results/theory/figures/fig1_introductory_example",
        "results/finite_state/figures/estimators",
        "results/finite_state/figures/identified_interval",
    }
    assert set(stems) == expected


@pytest.mark.slow
def test_tables_are_viewable_html(report):
    work, categories, results = report
    tables = categories["Language-model study"]["Tables"]
    expected = {
        f"results/{s}/tables/table{i}.html"
        for s in ("study1", "study2")
        for i in (1, 2, 3, 4, "_accuracy")
    }
    assert set(tables) == expected and len(tables) == len(expected)
    for path in tables + categories["Language-model study"]["Estimands"]:
        assert results[path]["mime_type"] == "text/html", path
        assert "<table" in (work / path).read_text()
    summaries = set(categories["Language-model study"]["Estimands"])
    assert summaries == {f"results/{s}/tables/estimands_summary.html" for s in ("study1", "study2")}
    # CSV only as downloadable data; no Markdown or LaTeX entries
    for path in results:
        assert not path.endswith((".md", ".tex")), path
        if path.endswith(".csv"):
            assert (
                path
                in categories["Language-model study"]["Data"]
                + categories["Finite-state study"]["Data"]
            ), path


@pytest.mark.slow
def test_accuracy_entries_sit_with_the_study_tables_and_figures(report):
    """Table A and the accuracy figure of each study: under Language-model study, Tables and
    Figures, labelled by study, with their captions."""
    work, categories, results = report
    study = categories["Language-model study"]
    for s in ("study1", "study2"):
        table, figure = (
            f"results/{s}/tables/table_accuracy.html",
            f"results/{s}/figures/accuracy.png",
        )
        assert table in study["Tables"] and figure in study["Figures"], s
        assert results[table]["mime_type"] == "text/html"
        assert "<table" in (work / table).read_text()
        assert results[figure]["mime_type"] == "image/png"
        for path in (table, figure):
            assert results[path]["labels"]["study"] == s, path
            assert "accuracy" in results[path]["caption"].lower(), path


@pytest.mark.parametrize(
    ("settings", "built"),
    [
        ({}, True),
        ({"targets": {"all"}}, True),
        ({"dryrun": True}, False),
        ({"touch": True}, False),
        ({"remote": True}, False),
        ({"targets": {"results/study1/tables/estimands.csv"}}, False),
        ({"targets": {"all", "study_tables"}}, False),
        ({"target_jobs": ["estimands:study=study1"]}, False),
        ({"until": {"materialize_documents"}}, False),
        ({"omit_from": {"estimands"}}, False),
        ({"allowed_rules": {"estimands", "prespecify"}}, False),
        ({"batch": "all=1/3"}, False),
        ({"targets": {"all"}, "until": {"plan_sample_sizes"}}, False),
    ],
)
def test_the_report_follows_only_a_real_run_of_the_default_target(settings, built):
    """The `onsuccess` handler's decision (workflow/rules/common.smk, `report_after_run`)."""
    from kvdiverge.pipeline.report import wants_report

    run = {"dryrun": False, "touch": False, "remote": False, "targets": set(), "target_jobs": []}
    assert wants_report(**{**run, **settings}) is built


def test_a_partial_run_says_what_made_it_partial_and_how_to_build_the_report():
    from kvdiverge.pipeline.report import partial_run, skipped_report

    assert partial_run() is None
    assert partial_run(targets={"all"}) is None
    assert partial_run(until={"materialize_documents"}) == "--until materialize_documents"
    assert (
        partial_run(targets={"all", "results/a.csv"}, allowed_rules={"b", "a"})
        == "the targets results/a.csv, --allowed-rules a b"
    )
    assert partial_run(omit_from={"estimands"}, batch="all=1/3") == (
        "--omit-from estimands, --batch all=1/3"
    )
    line = skipped_report(
        "results/report.html",
        "--until materialize_documents",
        [Path("configs/tiny.yaml").absolute()],
        replace=True,
    )
    assert line.startswith("Report skipped: a partial run (--until materialize_documents)")
    assert line.endswith(
        "`snakemake --report results/report.html --configfile configs/tiny.yaml "
        "--replace-workflow-config`."
    )
    assert "--configfile" not in skipped_report("r.html", "--until x")
    assert "--config <the same values>" in skipped_report("r.html", "x", config_values=True)
