"""The "report skipped" line's command runs as written for paths with
spaces and quotes (each path shell-quoted, kvdiverge.pipeline.report.skipped_report)."""

from __future__ import annotations

import shlex

from kvdiverge.pipeline.report import skipped_report


def test_the_report_command_splits_back_into_its_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report = "my results/report of 'study'.html"
    line = skipped_report(report, "--until x", ["configs/my run.yaml", "b.yaml"], replace=True)
    command = line.split("`")[1]
    assert shlex.split(command) == [
        "snakemake",
        "--report",
        report,
        "--configfile",
        "configs/my run.yaml",
        "b.yaml",
        "--replace-workflow-config",
    ]


def test_plain_paths_are_unchanged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = skipped_report("results/report.html", "--until x", ["a.yaml"])
    assert "`snakemake --report results/report.html --configfile a.yaml`" in line
