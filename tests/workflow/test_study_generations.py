"""The pipeline's page of generations side by side (issue 31, item 3): rule study_generations
draws a sample of a study's evaluation documents per model, action and stratum, deterministic
and mixing divergence timings, and shows their full-cache and evicted continuations with the
divergence token marked and δ_t along the text (kvdiverge.tables.generations, the code of
``kvdiverge compare``'s generations.html), checked in headless Chromium when it is installed."""

from __future__ import annotations

import html
import json

import numpy as np
import polars as pl
import pytest
import yaml
from browser_helpers import CHROMIUM, has_colour, render_in_chromium
from workflow_helpers import ROOT, fixture_stratum_config, package_env, run_snakemake, workflow_copy

from kvdiverge.analysis.accuracy import document_metrics
from kvdiverge.compare import compare
from kvdiverge.io.trajectories import read_trajectories
from kvdiverge.models.detokenize import load_decoder
from kvdiverge.tables.generations import (
    render_study_generations_html,
    sample_documents,
    sampled_generations,
    shown_timing,
)

MODEL = ROOT / "data" / "models" / "tiny-llama"
H, K, DEPTH = 8, 2, 4
ACTIONS = ["snapkv=snapkv@0.5+window=8", "recent=recent@0.25"]
LABELS = ("snapkv", "recent")
NAMES = [f"n{k}" for k in range(6)]
PROMPTS = [
    {
        "id": f"needle-{name}",
        "prompt": f"One of the special magic numbers for {name} is: {1000 + 37 * k}. Remember it. "
        f"The sea was calm and the sky was grey over the harbour for many days. What is the "
        f"special magic number for {name}?",
        "answers": [str(1000 + 37 * k)],
    }
    for k, name in enumerate(NAMES)
]


def _timing(rows: list[tuple[str, str, str]]) -> pl.DataFrame:
    return pl.DataFrame(rows, schema=["doc_id", "stratum", "timing"], orient="row")


def test_the_sample_mixes_timings_and_is_deterministic():
    rows = [(f"a/{i:02d}", "a", c) for i, c in enumerate(["early"] * 6 + ["late"] * 3 + ["never"])]
    rows += [(f"b/{i:02d}", "b", "early") for i in range(5)]
    timing = _timing(rows)
    sample = sample_documents(timing, 3, seed=7, key="m/snapkv")
    cls = dict(zip(timing["doc_id"], timing["timing"], strict=True))
    assert [cls[d] for d in sample["a"]] == ["early", "late", "never"]  # one of each, in order
    assert len(sample["b"]) == 3 and len(set(sample["b"])) == 3
    assert sample == sample_documents(timing, 3, seed=7, key="m/snapkv")
    draws = {tuple(sample_documents(timing, 3, seed=s, key="m/snapkv")["b"]) for s in range(20)}
    assert len(draws) > 1  # the seed chooses among the early documents
    (first,) = sample_documents(timing, 1, seed=7, key="m/snapkv")["a"]
    assert cls[first] == "early"
    small = sample_documents(_timing([("c/0", "c", "never"), ("c/1", "c", "late")]), 3, 1)
    assert small == {"c": ["c/1", "c/0"]}  # every document when a stratum has fewer
    with pytest.raises(ValueError, match="per_stratum: expected an integer >= 1, got 0"):
        sample_documents(timing, 0, seed=7)


def test_shown_timing_is_the_first_diverged_replicate():
    t = np.tile(np.arange(1, 5), 4)
    frame = pl.DataFrame(
        {
            "doc_id": ["d0"] * 8 + ["d1"] * 8,
            "replicate": np.repeat([0, 1, 0, 1], 4),
            "t": t,
            # d0: replicate 0 never, replicate 1 at t = 3; d1: never at all
            "mismatch": [False] * 6 + [True, True] + [False] * 8,
        }
    )
    got = shown_timing(frame, depth=2)
    assert got.rows() == [("d0", 3, "late"), ("d1", None, "never")]
    assert shown_timing(frame, depth=3)["timing"].to_list() == ["early", "never"]


@pytest.fixture(scope="module")
def rolled_out(tmp_path_factory):
    """A real rollout: the tiny demo Llama on six prompts under two actions (compare's
    trajectory files, the pipeline's contract), then the sampled page."""
    root = tmp_path_factory.mktemp("study-generations")
    out = root / "out"
    compare(MODEL, PROMPTS, ACTIONS, K=K, H=H, draws=20, seed=3, out=out)
    documents = document_metrics(
        pl.read_parquet(out / "documents.parquet"), lambda s, t: "substring_match"
    )
    frames = {
        a: read_trajectories(out / "trajectories" / f"{a}.parquet") for a in ("snapkv", "recent")
    }
    tokenizer = load_decoder(MODEL)
    table = sampled_generations(frames, documents, tokenizer, DEPTH, 2, seed=11, key="tiny-llama")
    page = root / "generations.html"
    text = render_study_generations_html(
        [("tiny-llama", table, documents, tokenizer)], "Generations side by side: study1"
    )
    page.write_text(text)
    return frames, documents, table, page


def test_the_sampled_generations_are_the_trajectories_own(rolled_out):
    frames, documents, table, _ = rolled_out
    chosen = table["doc_id"].unique().to_list()
    per_action = [
        sample_documents(
            shown_timing(f, DEPTH).join(documents.select("doc_id", "stratum"), on="doc_id"),
            2,
            seed=11,
            key=f"tiny-llama/{a}",
        )["custom-prompts"]
        for a, f in frames.items()
    ]
    assert sorted(chosen) == sorted(set(per_action[0]) | set(per_action[1]))
    assert 2 <= len(chosen) <= 4 and len(chosen) < len(PROMPTS)
    assert table.height == len(chosen) * K * len(frames)  # every action of a sampled document
    for action, frame in frames.items():
        rows = table.filter(pl.col("action") == action).sort("doc_id", "replicate")
        traj = frame.filter(pl.col("doc_id").is_in(chosen)).sort("doc_id", "replicate", "t")
        mism = traj["mismatch"].to_numpy().reshape(-1, H)
        assert rows["tau"].to_list() == [int(m.argmax()) + 1 if m.any() else None for m in mism]
        delta = traj["tv_rollout"].to_numpy().reshape(-1, H)
        np.testing.assert_allclose(np.array(rows["delta"].to_list()), delta, rtol=1e-6)
    # rerun: the same sample
    tokenizer = load_decoder(MODEL)
    again = sampled_generations(frames, documents, tokenizer, DEPTH, 2, seed=11, key="tiny-llama")
    assert again.equals(table)


def _shown(table: pl.DataFrame) -> pl.DataFrame:
    """The path the page shows per (document, action): the first diverged replicate, else 0."""
    return (
        table.sort("doc_id", "action", pl.col("tau").is_null(), "replicate")
        .group_by("doc_id", "action", maintain_order=True)
        .first()
    )


def test_the_page_marks_the_divergence_token_and_names_each_document(rolled_out):
    _, documents, table, page = rolled_out
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "<h2>Model tiny-llama</h2>" in text
    shown = _shown(table)
    for doc_id in table["doc_id"].unique().to_list():
        assert f"<h3>Document {doc_id} (custom-prompts, task custom)</h3>" in text
        prompt = documents.filter(pl.col("doc_id") == doc_id)["prompt"][0]
        assert html.escape(prompt) in text
    unsampled = set(documents["doc_id"]) - set(table["doc_id"])
    assert unsampled and not any(f"Document {d} " in text for d in unsampled)
    diverged = shown.filter(pl.col("tau").is_not_null())
    assert diverged.height > 0  # the tiny model diverges under a quarter of its cache
    assert text.count('<span class="div">') == 2 * diverged.height  # X's and Y's token
    for r in diverged.iter_rows(named=True):
        assert f"τ = {r['tau']}" in text
    never = shown.filter(pl.col("tau").is_null()).height
    assert text.count(f"never diverged within H = {H}") == never
    assert text.count("<tr><th>snapkv</th>") == text.count("<tr><th>recent</th>")
    assert 'title="δ_t = ' in text  # δ_t along the shared prefix
    # an action's display label heads its rows where one is given
    tokenizer = load_decoder(MODEL)
    labelled = render_study_generations_html(
        [("tiny-llama", table, documents, tokenizer)], "t", labels={"snapkv": "SnapKV <half>"}
    )
    assert labelled.count("<tr><th>SnapKV &lt;half&gt;</th>") == text.count("<tr><th>snapkv</th>")
    assert "<tr><th>snapkv</th>" not in labelled and "<tr><th>recent</th>" in labelled


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed")
def test_the_page_renders_in_headless_chromium(rolled_out, tmp_path):
    _, _, table, page = rolled_out
    dom, pixels = render_in_chromium(page, tmp_path, size=(1200, 2400))
    assert 'class="gen x"' in dom and 'class="div"' in dom
    assert f"Document {table['doc_id'][0]} " in dom
    assert has_colour(pixels, (0xCF, 0xE3, 0xF7)) and has_colour(pixels, (0xFB, 0xD9, 0xC3))


SMALL = fixture_stratum_config(
    H=8,
    max_K=2,
    studies={
        "study1": {
            "actions": ["snapkv-half", "recent-half", "full"],
            "K": 2,
            "K_dev": 2,
            "K_control": 1,
            "bootstrap_draws": 2000,
        },
        "study2": {"actions": ["recent-90", "full"], "K": 2, "K_dev": 2},
    },
    actions={"snapkv-half": {"selector": "snapkv", "budget": 0.5, "label": "SnapKV, half"}},
)


@pytest.mark.slow
def test_rule_study_generations_writes_the_page(tmp_path):
    """The rule on the tiny config's fixture stratum, through its rollouts: the page and its
    Parquet, the log and benchmark, each model's sampled documents."""
    from test_study_contrasts import _documents_with_lengths

    work = workflow_copy(tmp_path, package=True)
    (work / "results" / "documents").mkdir(parents=True)
    _documents_with_lengths(work / "results" / "documents" / "ruler-1024.parquet")
    override = tmp_path / "small.yaml"
    override.write_text(yaml.safe_dump(SMALL))
    rules = [
        "build_demo_model", "dev_rollout_study1", "plan_sample_sizes", "prespecify",
        "rollout_study1", "study_generations",
    ]  # fmt: skip
    res = run_snakemake(
        work, "results/study1/tables/generations.html", "--allowed-rules", *rules,
        "--configfile", str(override), env=package_env(work), timeout=900,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (work / "results/logs/analysis/study_generations/study1.log").exists()
    assert (work / "results/benchmarks/study_generations/study1.tsv").exists()
    text = (work / "results/study1/tables/generations.html").read_text()
    table = pl.read_parquet(work / "results/study1/tables/generations.parquet")
    assert table["model"].unique(maintain_order=True).to_list() == ["tiny-llama", "tiny-qwen"]
    assert set(table["action"]) == {"snapkv-half", "recent-half"}  # not the control
    for model in ("tiny-llama", "tiny-qwen"):
        assert f"<h2>Model {model}</h2>" in text
        rows = table.filter(pl.col("model") == model)
        assert set(rows["doc_id"]) <= {f"ruler-1024/study1/00{i}" for i in range(3)}
        for doc_id in rows["doc_id"].unique().to_list():
            assert f"Document {doc_id} (ruler-1024, task niah_single_1)" in text
    shown = [_shown(table.filter(pl.col("model") == m)) for m in ("tiny-llama", "tiny-qwen")]
    diverged = sum(s.filter(pl.col("tau").is_not_null()).height for s in shown)
    assert text.count('<span class="div">') == 2 * diverged
    assert "up to 3 evaluation documents per model, action and stratum" in text
    assert text.count("<tr><th>SnapKV, half</th>") == text.count("<tr><th>recent-half</th>") > 0

    # the report: the page under Language-model study / Generations with its caption, and a
    # link to it on the landing page
    from test_report import report_entries

    page = "results/study1/tables/generations.html"
    res = run_snakemake(
        work, page, "--configfile", str(override), "--report", "report.html",
        env=package_env(work), timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = (work / "report.html").read_text(errors="replace")
    categories, results = report_entries(report)
    assert categories["Language-model study"]["Generations"] == [page]
    assert "divergence token" in results[page]["caption"]
    start = report.index("var workflow_desc = ") + len("var workflow_desc = ")
    landing, _ = json.JSONDecoder().raw_decode(report, start)
    assert f"javascript:app.showResultInfo('{page}')" in landing
