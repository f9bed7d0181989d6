"""The report leads with its answer (kvdiverge.tables.landing) and is never silently stale
(kvdiverge.pipeline.report): built into a hidden sibling and renamed when complete; a report
older than a result, or whose last build was interrupted, is named in one line."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import polars as pl
import pytest

from kvdiverge.pipeline import report as report_module
from kvdiverge.pipeline.report import build_report, building_path, stale_report
from kvdiverge.tables.headline import headline_table
from kvdiverge.tables.landing import landing_documents, render_landing_rst


def _touch(path: Path, when: float) -> Path:
    path.write_text("x")
    os.utime(path, (when, when))
    return path


def test_a_report_newer_than_every_result_is_fresh(tmp_path):
    now = time.time()
    result = _touch(tmp_path / "estimands.csv", now - 100)
    report = _touch(tmp_path / "report.html", now)
    assert stale_report(report, [result, tmp_path / "absent.csv"]) is None
    assert stale_report(tmp_path / "none.html", [result]) is None  # no report yet


def test_a_report_older_than_a_result_is_named(tmp_path):
    now = time.time()
    report = _touch(tmp_path / "report.html", now - 100)
    a, b = _touch(tmp_path / "a.csv", now), _touch(tmp_path / "b.csv", now)
    line = stale_report(report, [a, b])
    assert line == (
        f"{report} is older than {a} and 1 more: it does not show the current results; a run "
        f"of the default target with jobs to do rebuilds it, else build it with `snakemake "
        f"--report {report}` (the same config options)"
    )


def test_a_killed_build_keeps_the_old_report_and_is_named(tmp_path, monkeypatch):
    report = _touch(tmp_path / "report.html", time.time())
    old = report.read_text()

    def killed(command, **kwargs):  # writes part of the report, then dies
        target = Path(command[command.index("--report") + 1])
        assert target == building_path(report) and target.name == ".report.building.html"
        target.write_text("<html>half")
        return subprocess.CompletedProcess(command, -9)

    monkeypatch.setattr(report_module.subprocess, "run", killed)
    with pytest.raises(RuntimeError, match="failed"):
        build_report(report, "Snakefile", {"a": 1}, tmp_path / "report.log")
    assert report.read_text() == old  # the earlier report, whole
    line = stale_report(report, [])
    assert line.startswith(f"{report}: its last build was interrupted ({building_path(report)}")

    def built(command, **kwargs):
        Path(command[command.index("--report") + 1]).write_text("<html>new</html>")
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(report_module.subprocess, "run", built)
    build_report(report, "Snakefile", {"a": 1}, tmp_path / "report.log")
    assert report.read_text() == "<html>new</html>" and not building_path(report).exists()
    assert stale_report(report, []) is None


def _study_tables():
    rows, acc, con = [], [], []
    for action, p in (("snapkv", 0.5), ("mine", 0.75)):
        for e, v in (("div_prob", p), ("mean_entry_time", 5.0), ("R_smc", p / 3)):
            rows.append({"model": "m", "action": action, "contrast": "", "stratum": "pooled",
                         "estimand": e, "value": v, "ci_low": v - 0.1, "ci_high": v + 0.1,
                         "ci_level": 0.95, "n_docs": 4})  # fmt: skip
            rows.append(rows[-1] | {"stratum": "ruler-768", "n_docs": 4})
        for e in ("accuracy_x", "accuracy_y"):
            acc.append({"model": "m", "action": action, "contrast": "", "stratum": "pooled",
                        "estimand": e, "value": 0.25, "ci_low": 0.0, "ci_high": 0.5,
                        "ci_level": 0.95, "n_docs": 4})  # fmt: skip
    for e, v in (("R_smc", 0.083), ("div_prob", 0.25), ("mean_entry_time", 0.0), ("accuracy", 0.0)):
        con.append({"model": "m", "action": "mine", "baseline": "snapkv", "estimand": e,
                    "value": v, "ci_low": v - 0.3, "ci_high": v + 0.3, "ci_level": 0.95,
                    "action_value": 0.5, "baseline_value": 0.5, "n_docs": 4})  # fmt: skip
    for e in ("occurrence_share", "exposure_share", "rate_share"):
        con.append(con[0] | {"estimand": e, "value": 1 / 3})
    return pl.DataFrame(rows), pl.DataFrame(acc), pl.DataFrame(con)


def test_the_landing_page_leads_with_the_headline_then_the_figure_then_the_sentences(tmp_path):
    from docutils.core import publish_parts

    estimands, accuracy, contrasts = _study_tables()
    png = tmp_path / "fig5.png"
    png.write_bytes(b"\x89PNG fake")
    docs = landing_documents(estimands, ["ruler-768"])
    assert docs == {"ruler-768": 4}
    text = render_landing_rst(
        "study1", headline_table(estimands, accuracy, ["snapkv", "mine"]), contrasts, H=32,
        temperature=0.0, documents=docs, labels={"mine": "Mine"}, figure=png,
        registration="Registration 1 of study1.",
    )  # fmt: skip
    order = [
        text.index("**study1** — m; 4 evaluation documents (4 in ruler-768), H = 32"),
        text.index(".. list-table:: study1, m: 4 documents, pooled"),
        text.index("each action minus the baseline"),
        text.index("data:image/png;base64,"),
        text.index("- m: Mine diverges from the full-cache model"),
        text.index("What 4 documents allow: Task accuracy cannot separate these actions with 4"),
    ]
    assert order == sorted(order)
    assert "one document moves an action's accuracy by 25 points" in text
    assert max(len(line) for line in text.splitlines()) < 10_000  # docutils' line limit
    html = publish_parts(text, writer="html", settings_overrides={"report_level": 2})
    body = html["body"]
    assert body.count("<table") == 2 and "System Message" not in body
    assert "Mine" in body and "0.0 [-30.0, 30.0] (includes 0)" in body


def test_the_rule_graph_has_one_node_per_rule():
    from types import SimpleNamespace

    from kvdiverge.pipeline.report_graph import rule_graph

    class Job:  # hashable by identity, as Snakemake's jobs are dict keys
        def __init__(self, rule: str) -> None:
            self.rule = SimpleNamespace(name=rule)

    job = Job

    est1, est2, pred1 = job("estimands"), job("estimands"), job("prediction")
    tab1, tab2 = job("study_tables"), job("study_tables")  # study 1 waits for its prediction
    levels = [[est1, est2], [pred1, tab2], [tab1]]
    deps = {est1: [], est2: [], pred1: [est1], tab2: [est2], tab1: [est1, pred1]}
    dag = SimpleNamespace(toposorted=lambda: levels, dependencies=deps)
    spec, _, ymax = rule_graph(dag)
    assert [n["rule"] for n in spec["nodes"]] == ["estimands", "prediction", "study_tables"]
    edges = {(e["sourcerule"], e["targetrule"]) for e in spec["links"] + spec["links_direct"]}
    assert edges == {("estimands", "prediction"), ("estimands", "study_tables"),
                     ("prediction", "study_tables")}  # fmt: skip
    assert ymax == 100
