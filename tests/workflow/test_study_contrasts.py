"""A study's baseline (issue 31, item 2): ``studies.<study>.baseline`` is checked in one line;
rule study_contrasts writes every compared action minus the baseline per model
(``contrasts.{csv,md}``, ``summary.md``, ``summary.html``) from the study's own estimands rows and
its documents' accuracy, with paired bootstrap intervals (kvdiverge.tables.contrasts, which
``kvdiverge compare --baseline`` uses too)."""

from __future__ import annotations

import copy
import json
import math

import polars as pl
import pytest
import yaml
from workflow_helpers import ROOT, fixture_stratum_config, package_env, run_snakemake, workflow_copy

from kvdiverge.analysis.prespecification import read_lock, registration_line
from kvdiverge.config import ConfigError, check_config
from kvdiverge.tables.contrasts import CONTRAST_ESTIMANDS, summary_paragraphs

SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
FIXTURE = ROOT / "tests" / "data" / "documents" / "ruler-1024.parquet"
BASE = yaml.safe_load((ROOT / "config.yaml").read_text())


def _with_baseline(study: str, baseline, **edit) -> dict:
    config = copy.deepcopy(BASE)
    config["studies"][study].update(baseline=baseline, **edit)
    return config


def test_a_baseline_among_the_compared_actions_is_accepted():
    config = _with_baseline("study1", "snapkv-half")
    check_config(config, SCHEMA)
    assert config["studies"]["study1"]["baseline"] == "snapkv-half"


@pytest.mark.parametrize(
    "baseline, edit, message",
    [
        (
            "snapkv-quarter",
            {},
            "config.studies.study1.baseline: 'snapkv-quarter' is not a compared action of the "
            "study; expected one of snapkv-512, snapkv-half, recent-half (not the control 'full')",
        ),
        (
            "full",
            {},
            "config.studies.study1.baseline: 'full' is not a compared action of the study; "
            "expected one of snapkv-512, snapkv-half, recent-half (not the control 'full')",
        ),
        (
            "recent-90",
            {"actions": ["recent-90", "full"]},
            "config.studies.study1.baseline: 'recent-90' is the study's only compared action; "
            "expected a study with another action to set against it",
        ),
        (3, {}, "config.studies.study1.baseline: expected string, got 3"),
    ],
)
def test_a_bad_baseline_is_one_line(baseline, edit, message):
    config = _with_baseline("study1", baseline, **edit)
    if "actions" in edit:
        config["analysis"]["contrasts"].pop("study1", None)
        config["analysis"]["prediction"]["pairs"].pop("study1", None)
        config["figures"]["main_contrast"].pop("study1", None)
    with pytest.raises(ConfigError) as info:
        check_config(config, SCHEMA)
    assert str(info.value) == message


def test_summary_paragraphs_pair_each_title_with_its_sentences():
    text = "# m: against the baseline\n\nintro.\n\n## m: a against b\n\nA is later.\n"
    assert summary_paragraphs(text) == [
        ("m: against the baseline", "intro."),
        ("m: a against b", "A is later."),
    ]


SMALL = fixture_stratum_config(
    H=10,
    max_K=2,
    studies={
        "study1": {
            "actions": ["snapkv-half", "recent-half", "recent-90", "full"],
            "K": 2,
            "K_dev": 2,
            "K_control": 1,
            "baseline": "snapkv-half",
            "bootstrap_draws": 2000,
        },
        "study2": {"actions": ["recent-90", "full"], "K": 2, "K_dev": 2},
    },
)


def _documents_with_lengths(path) -> None:
    """The fixture stratum's documents with their ``n_tokens`` (the chat-wrapped prompt's
    length under the config's length tokenizer, tiny-llama), which the accuracy rule reads."""
    from kvdiverge.io.documents import write_documents
    from kvdiverge.models import chat_prompt_ids, load_tokenizer

    tok = load_tokenizer(str(ROOT / "data" / "models" / "tiny-llama"))
    docs = pl.read_parquet(FIXTURE)
    lengths = [len(chat_prompt_ids(tok, p)) for p in docs["prompt"]]
    write_documents(docs.with_columns(n_tokens=pl.Series(lengths, dtype=pl.Int64)), path)


@pytest.mark.slow
def test_study_contrasts_set_each_action_against_the_baseline(tmp_path):
    work = workflow_copy(tmp_path, package=True)
    (work / "results" / "documents").mkdir(parents=True)
    _documents_with_lengths(work / "results" / "documents" / "ruler-1024.parquet")
    override = tmp_path / "baseline.yaml"
    override.write_text(yaml.safe_dump(SMALL))
    tables = work / "results" / "study1" / "tables"
    targets = [f"results/study1/tables/{n}" for n in ("contrasts.csv", "summary.html")]
    targets += ["results/study1/metrics.json", "results/study1/tables/landing.rst"]
    rules = [
        "build_demo_model", "dev_rollout_study1", "plan_sample_sizes", "prespecify",
        "rollout_study1", "document_stats", "estimands", "accuracy", "study_contrasts",
        "study_figures", "study_metrics",
    ]  # fmt: skip
    res = run_snakemake(
        work, *targets, "--allowed-rules", *rules, "--configfile", str(override),
        env=package_env(work), timeout=900,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (work / "results/logs/figures/study_contrasts/study1.log").exists()
    # metrics.json holds the contrasts file's rows; landing.rst leads with the headline table
    from kvdiverge.tables.metrics import read_metrics

    record = read_metrics(work / "results" / "study1")
    assert (
        record["kind"] == "study"
        and record["lock"] == read_lock(work / "results/study1/lock.json")["hash"]
    )
    assert len(record["contrasts"]) == pl.read_csv(tables / "contrasts.csv").height
    landing = (tables / "landing.rst").read_text()
    assert landing.index(".. list-table::") < landing.index("data:image/png;base64,")
    assert (work / "results/benchmarks/study_contrasts/study1.tsv").exists()
    table = pl.read_csv(tables / "contrasts.csv")
    models = ["tiny-llama", "tiny-qwen"]
    assert table["model"].unique(maintain_order=True).to_list() == models
    assert table["action"].unique(maintain_order=True).to_list() == ["recent-half", "recent-90"]
    assert set(table["baseline"]) == {"snapkv-half"}
    for model in models:
        for action in ("recent-half", "recent-90"):
            rows = table.filter((pl.col("model") == model) & (pl.col("action") == action))
            assert rows["estimand"].to_list() == list(CONTRAST_ESTIMANDS)
    # the timing rows are the estimands table's own contrast rows `action - baseline`
    estimands = pl.read_csv(tables / "estimands.csv", comment_prefix="#")
    pooled = estimands.filter(pl.col("stratum") == "pooled")
    for r in table.filter(pl.col("estimand") != "accuracy").iter_rows(named=True):
        (own,) = pooled.filter(
            (pl.col("model") == r["model"])
            & (pl.col("contrast") == f"{r['action']} - snapkv-half")
            & (pl.col("estimand") == r["estimand"])
        ).iter_rows(named=True)
        for key in ("value", "ci_low", "ci_high"):
            assert r[key] == pytest.approx(own[key], nan_ok=True, rel=1e-12)
    # Δ accuracy: the documents' mean accuracy of Y, action minus baseline, with an interval
    acc = pl.read_parquet(tables / "accuracy_documents.parquet").filter(
        pl.col("cohort") == "study1"
    )
    for r in table.filter(pl.col("estimand") == "accuracy").iter_rows(named=True):
        mine = acc.filter((pl.col("model") == r["model"]) & (pl.col("action") == r["action"]))
        base = acc.filter((pl.col("model") == r["model"]) & (pl.col("action") == "snapkv-half"))
        assert r["action_value"] == pytest.approx(mine["acc_y"].mean())
        assert r["value"] == pytest.approx(mine["acc_y"].mean() - base["acc_y"].mean())
        assert r["n_docs"] == 3 and math.isfinite(r["ci_low"]) and r["ci_low"] <= r["value"]
    summary = (tables / "summary.md").read_text()
    titles = [t for t, _ in summary_paragraphs(summary) if t]
    assert titles == [
        f"{m}: {t}"
        for m in models
        for t in (
            "against the baseline", "recent-half against snapkv-half",
            "recent-90 against snapkv-half",
        )
    ]  # fmt: skip
    assert "3 documents, H = 10 generated tokens, temperature 1;" in summary
    assert "recent-half diverges from the full-cache model within H = 10 steps on" in summary
    lock = read_lock(work / "results/study1/lock.json")
    assert summary.splitlines()[-1] == registration_line(lock)  # the registration it rests on
    html = (tables / "summary.html").read_text()
    assert "<h2>tiny-qwen: recent-90 against snapkv-half</h2>" in html
    md = (tables / "contrasts.md").read_text()
    assert md.startswith("| model | action | baseline |") and "| tiny-qwen | recent-90 |" in md

    # the report opens on the answer: each study's headline before the workflow's description,
    # the full sentences and the estimands summary one click away
    built = run_snakemake(
        work, "results/study1/tables/estimands_summary.html", "--allowed-rules", "study_tables",
        "prediction", "--configfile", str(override), env=package_env(work), timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    shown = [
        f"results/study1/tables/{n}"
        for n in ("summary.html", "estimands_summary.html", "table_accuracy.html")
    ]
    res = run_snakemake(
        work, *shown, "--configfile", str(override), "--report", "report.html",
        env=package_env(work), timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    page = (work / "report.html").read_text(errors="replace")
    start = page.index("var workflow_desc = ") + len("var workflow_desc = ")
    landing, _ = json.JSONDecoder().raw_decode(page, start)
    answer, about = landing.index("The answer"), landing.index("About the workflow")
    assert answer < about
    rst = (tables / "summary.rst").read_text()
    assert rst.count("\n- ") == 4  # one line per model and action
    row = table.filter(
        (pl.col("model") == "tiny-qwen")
        & (pl.col("action") == "recent-half")
        & (pl.col("estimand") == "R_smc")
    ).row(0, named=True)
    headline = (
        "recent-half's R_SMC (the share of steps whose token differs from the full cache's) is "
        f"{row['action_value']:.3f}"
    )
    assert answer < landing.index(headline) < about
    for target in ("summary.html", "estimands_summary.html"):
        link = f"javascript:app.showResultInfo('results/study1/tables/{target}')"
        assert link in landing
    assert "System Message" not in landing
