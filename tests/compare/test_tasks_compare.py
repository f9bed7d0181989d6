"""``kvdiverge compare --tasks`` (kvdiverge.compare.tasks): named suites built by the package's
own generators at the model's tokenization, each document with its answers and its suite's
metric, so accuracy and divergence come from one command; ``--tasks list``; bad items in one
line before any model work; and the headline table (kvdiverge.tables.headline)."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from kvdiverge.cli import main
from kvdiverge.compare import CompareError, compare
from kvdiverge.compare.tasks import parse_tasks, task_list
from kvdiverge.datasets import RULER_TASKS
from kvdiverge.tables.headline import (
    accuracy_resolution,
    headline_table,
    render_headline_markdown,
    render_headline_rst,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "data" / "models" / "tiny-llama"


def test_the_list_names_every_suite_and_task(capsys):
    assert main(["compare", "--tasks", "list"]) == 0
    out = capsys.readouterr().out
    assert out == task_list() + "\n"
    assert out.startswith("ruler: " + ", ".join(RULER_TASKS) + "\n")
    assert "helmet: kilt_nq, kilt_triviaqa" in out


@pytest.mark.parametrize(
    "text,message",
    [
        ("ruler", "--tasks: 'ruler': expected SUITE:TASK with SUITE one of ruler, helmet"),
        ("lm:hellaswag", "--tasks: 'lm:hellaswag': expected SUITE:TASK with SUITE one of"),
        ("ruler:niah_single", "ruler has no task 'niah_single'; expected one of niah_single_1"),
        ("ruler:vt,ruler:vt", "--tasks: 'ruler:vt' given twice"),
    ],
)
def test_bad_task_items_are_one_line(text, message):
    with pytest.raises(CompareError) as err:
        parse_tasks(text)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_suite_too_long_for_the_context_is_one_line():
    with pytest.raises(CompareError) as err:
        compare(MODEL, None, "recent@0.5", H=6, quiet=True, tasks="ruler:vt", context=512, limit=1)
    assert str(err.value).startswith("--tasks ruler: ruler-512 vt: the shortest prompt needs ")
    assert "tokens under tiny-llama's chat template, over the budget of 506" in str(err.value)


def test_a_misspelt_task_gets_a_suggestion():
    with pytest.raises(CompareError, match=r"did you mean ruler:niah_single_1\?"):
        parse_tasks("ruler:niah_singel_1")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"tasks": "ruler:vt"}, "--tasks: expected --context TOKENS"),
        ({"tasks": "ruler:vt", "context": 8}, "--context: expected a token count above H = 8"),
        ({"tasks": "ruler:vt", "context": 512, "limit": 0}, "--limit: expected an integer >= 1"),
        ({"prompts": "x.jsonl", "tasks": "ruler:vt"}, "either --prompts or --tasks, not both"),
        ({}, "--prompts: expected a prompts file (or --tasks SUITE:TASK,...)"),
    ],
)
def test_a_bad_task_run_is_refused_before_the_model(kwargs, message):
    prompts = kwargs.pop("prompts", None)
    with pytest.raises(CompareError) as err:
        compare("/nonexistent/model", prompts, "recent@0.5", H=8, quiet=True, **kwargs)
    assert message in str(err.value)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tasks") / "out"
    result = compare(
        MODEL, None, "recent=recent@0.5", baseline="snap=snapkv@0.5+window=8", K=2, H=6,
        draws=30, out=out, quiet=True, tasks="ruler:niah_single_1,ruler:vt", context=1024,
        limit=2,
    )  # fmt: skip
    return result, out


def test_the_suite_builds_limit_documents_per_task_with_answers_and_metrics(run):
    result, out = run
    docs = result.documents
    assert docs["stratum"].unique().to_list() == ["ruler-1024"]
    assert sorted(docs["task"].to_list()) == ["niah_single_1"] * 2 + ["vt"] * 2
    assert all(len(a) >= 1 for a in docs["answers"].to_list())
    assert all(n + 6 <= 1024 for n in docs["n_tokens"].to_list())  # the prompt plus H fits
    # accuracy and divergence of the same documents from one run
    acc = result.accuracy.filter(pl.col("stratum") == "pooled")
    assert set(acc["action"]) == {"snap", "recent"} and acc["n_docs"].max() == 4
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# Each action\n")
    assert (
        "| action | P(τ ≤ H), % | E[τ \\| τ ≤ H], steps | R_SMC, % | accuracy, full cache"
        in summary
    )
    assert "(string_match_all" in summary  # RULER's metric, not the default substring_match
    gen = pl.read_parquet(out / "generations.parquet")
    assert gen.height > 0
    assert "τ of every replicate: " in (out / "generations.html").read_text()  # K = 2


def test_the_headline_holds_the_tables_own_numbers(run):
    result, _ = run
    head = headline_table(result.estimands, result.accuracy, ["snap", "recent"])
    for r in head.iter_rows(named=True):
        source = result.accuracy if r["estimand"].startswith("accuracy") else result.estimands
        own = source.filter(
            (pl.col("stratum") == "pooled") & (pl.col("action") == r["action"])
            & (pl.col("estimand") == r["estimand"]) & (pl.col("contrast").fill_null("") == "")
        )  # fmt: skip
        assert own.select("value", "ci_low", "ci_high").row(0) == pytest.approx(
            (r["value"], r["ci_low"], r["ci_high"]), nan_ok=True, rel=0, abs=0
        )
    md = render_headline_markdown(head)
    assert md.startswith("**tiny-llama**, 4 documents;") and md.count("\n| ") == 3
    rst = render_headline_rst(head, {"snap": "SnapKV"}, title="study1")
    assert rst.startswith(".. list-table:: study1, tiny-llama: 4 documents") and "* - SnapKV" in rst


def test_the_documents_say_what_accuracy_can_separate():
    def table(acc, timing):
        return pl.DataFrame(
            [{"estimand": "accuracy", "ci_low": acc[0], "ci_high": acc[1]},
             {"estimand": "R_smc", "ci_low": timing[0], "ci_high": timing[1]}]
        )  # fmt: skip

    assert accuracy_resolution(table((-0.5, 0.25), (0.01, 0.2)), 4) == (
        "Task accuracy cannot separate these actions with 4 documents: every interval of a "
        "difference in accuracy includes 0 (one document moves an action's accuracy by 25 "
        "points); P(τ ≤ H) or R_SMC does for some of them (an interval of their difference "
        "excludes 0)."
    )
    assert accuracy_resolution(table((-0.5, 0.25), (-0.1, 0.2)), 4).endswith("by 25 points).")
    assert accuracy_resolution(table((0.1, 0.25), (-0.1, 0.2)), 4) is None
    assert accuracy_resolution(None, 4) is None
