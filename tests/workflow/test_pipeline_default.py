"""The embedded default end to end: `snakemake --cores 2` in a fresh copy of the repository
builds every output of `rule all`, passes the full-retention control, and ends by building
the report (`snakemake --report` from the workflow's `onsuccess` handler): every figure and
table in one HTML file. SmolLM2 comes materialized from its package once per test session
(the `smollm2_folder` fixture); the rule `materialize_model` itself runs in test_model_sources
on a tiny GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from conftest import shared_base
from filelock import FileLock
from test_report import report_entries
from workflow_helpers import planned_jobs, run_snakemake, workflow_copy


def _workflow_lock(work: Path) -> FileLock:
    """One Snakemake command at a time in the shared run's folder (workers share it)."""
    return FileLock(str(work.parent / "snakemake.lock"))


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, smollm2_folder):
    """One run of the default for the whole test session: pytest-xdist workers share it through
    their common base folder, under a lock (the first one runs it, the others wait and reuse).
    Without xdist the session's own base folder holds it: a later session never reuses it."""
    shared = shared_base(tmp_path_factory)
    with FileLock(str(shared / "default_run.lock")):
        record = shared / "default_run.json"
        if record.exists():
            saved = json.loads(record.read_text())
            return Path(saved["work"]), saved["planned"]
        folder = shared / "default_run"
        folder.mkdir(exist_ok=True)
        work = workflow_copy(folder, config="default", smollm2=smollm2_folder[0])
        dry = run_snakemake(work, "-n")
        assert dry.returncode == 0, dry.stdout[-3000:] + dry.stderr[-3000:]
        assert not (work / "results/report.html").exists()  # a dry run builds no report
        res = run_snakemake(work, timeout=1800)
        assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-5000:]
        record.write_text(json.dumps({"work": str(work), "planned": planned_jobs(dry)}))
        return work, planned_jobs(dry)


@pytest.mark.slow
def test_every_output_of_rule_all_exists(default_run):
    work, planned = default_run
    assert planned["all"] == 1 and sum(planned.values()) > 20
    outputs = [
        "results/finite_state/systems.csv",
        "results/theory/figures/fig1_introductory_example.png",
        "results/study1/tables/estimands.csv",
        "results/study1/tables/prediction.csv",
        "results/study1/plan.json",
        "results/study2/figures/fig7_branch_contrasts.pdf",
        "results/study1/figures/fig5_divergence_cdf.png",
        "results/study2/figures/fig6_tv_profiles.png",
        "results/study1/tables/table4.tex",
    ]
    for path in outputs:
        assert (work / path).stat().st_size > 0, path
    with _workflow_lock(work):
        rerun = run_snakemake(work, "-n")
    assert planned_jobs(rerun) == {}, rerun.stdout[-2000:]


@pytest.mark.slow
def test_control_is_exact_and_eviction_diverges(default_run):
    work, _ = default_run
    table = pl.read_csv(work / "results/study1/tables/estimands.csv")
    pooled = table.filter(
        (pl.col("stratum") == "pooled") & (pl.col("contrast").fill_null("") == "")
    )
    control = pooled.filter((pl.col("action") == "full") & pl.col("estimand").is_in(["R", "F"]))
    # the control runs its own rows over a gather of every position: rounding of threaded
    # matrix products only (its tolerance, kvdiverge.analysis.control.CONTROL_TOLERANCE)
    assert control.height > 0 and (control["value"].abs() < 1e-4).all()
    evicted = pooled.filter((pl.col("action") == "recent-half") & (pl.col("estimand") == "R_smc"))
    assert evicted.height > 0 and (evicted["value"] > 0).all()


@pytest.mark.slow
def test_the_run_builds_the_report_with_every_figure_and_table(default_run):
    """The one command's report (no second command), with the accuracy entries."""
    work, _ = default_run
    html = (work / "results/report.html").read_text(errors="replace")
    for name in ("fig5_divergence_cdf", "fig1_introductory_example", "estimators", "table1"):
        assert name in html, name
    categories, _ = report_entries(html)
    study = categories["Language-model study"]
    for s in ("study1", "study2"):
        assert f"results/{s}/tables/table_accuracy.html" in study["Tables"], s
        assert f"results/{s}/figures/accuracy.png" in study["Figures"], s
