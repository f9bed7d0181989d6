"""`kvdiverge compare` end to end on a small JSONL with a tiny demo model, its Python API, and its
bad inputs (one line each, before the model loads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from test_compare_folder import SELECTOR

from kvdiverge.cli import main
from kvdiverge.compare import CompareError, compare, parse_action_list
from kvdiverge.io.trajectories import read_trajectories
from kvdiverge.tables import read_estimands

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "data" / "models" / "tiny-llama"
ACTIONS = "snapkv@0.5+window=8,recent@0.5"

PROMPTS = [
    {
        "id": "fox",
        "prompt": "One of the special magic numbers for red-fox is: 1234567. Remember it. "
        "What is the special magic number for red-fox?",
        "answers": ["1234567"],
        "task": "niah",
    },
    {
        "prompt": "The capital of the invented land Zorbia is Quell, a city by the sea. "
        "What is the capital of Zorbia?",
        "answers": "Quell",
    },
]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return path


@pytest.fixture(scope="module")
def run(prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "out"
    argv = ["compare", "--model", str(MODEL), "--prompts", str(prompts), "--actions", ACTIONS]
    argv += ["--K", "2", "--H", "6", "--draws", "50", "--out", str(out)]
    assert main(argv) == 0
    return out


def test_compare_writes_table1_figure5_and_accuracy(run):
    for name in (
        "table1.csv",
        "table1.html",
        "table1.tex",
        "fig5_divergence_cdf.png",
        "fig5_divergence_cdf.pdf",
        "accuracy.csv",
        "table_accuracy.html",
        "accuracy.png",
        "estimands.csv",
        "documents.parquet",
        "generations.parquet",
    ):
        assert (run / name).stat().st_size > 0, name
    table1 = pl.read_csv(run / "table1.csv")
    assert table1["action"].to_list() == ACTIONS.split(",")
    assert "<table" in (run / "table_accuracy.html").read_text()
    documents = pl.read_parquet(run / "documents.parquet")
    assert documents["doc_id"].to_list() == [
        "custom-prompts/study1/000",
        "custom-prompts/study1/001",
    ]
    assert documents["task"].to_list() == ["niah", "custom"]
    assert documents["answers"].to_list() == [["1234567"], ["Quell"]]


def test_compare_outputs_agree_with_each_other(run):
    estimands = read_estimands(run / "estimands.csv")
    accuracy = read_estimands(run / "accuracy.csv").filter(pl.col("stratum") == "pooled")
    for action in ACTIONS.split(","):
        traj = read_trajectories(run / "trajectories" / f"{action}.parquet")
        assert traj.height == 2 * 2 * 6  # documents × K × H
        diverged = traj.group_by("doc_id", "replicate").agg(pl.col("mismatch").any())
        est = estimands.filter((pl.col("action") == action) & (pl.col("stratum") == "pooled"))
        value = dict(zip(est["estimand"], est["value"], strict=True))
        per_doc = diverged.group_by("doc_id").agg(pl.col("mismatch").mean())["mismatch"].mean()
        assert value["div_prob"] == pytest.approx(per_doc, abs=1e-12)
        assert value["div_cdf@6"] == value["div_prob"]
        acc = accuracy.filter(pl.col("action") == action)
        got = dict(zip(acc["estimand"], acc["value"], strict=True))
        assert got["share@never"] == pytest.approx(1 - value["div_prob"], abs=1e-12)
        if got["share@never"] > 0:
            assert got["accuracy_drop@never"] == 0.0
    # the shared reference: both actions score the same X generations
    x = accuracy.filter(pl.col("estimand") == "accuracy_x")["value"].to_list()
    assert x[0] == x[1]
    # every path's texts: X alike across actions, Y equal to X where the path never diverged
    gen = pl.read_parquet(run / "generations.parquet")
    assert gen.height == 2 * 2 * 2  # actions × documents × K
    by_action = [g.sort("doc_id", "replicate") for _, g in gen.group_by("action")]
    assert by_action[0]["x_text"].to_list() == by_action[1]["x_text"].to_list()
    never = gen.filter(pl.col("timing") == "never")
    assert never["x_text"].to_list() == never["y_text"].to_list()
    assert set(gen["timing"]) <= {"early", "late", "never"}


def test_the_python_api_returns_frames(prompts):
    result = compare(MODEL, prompts, ["recent@0.5"], K=1, H=4, draws=20)
    assert result.files == {}
    assert result.table1["action"].to_list() == ["recent@0.5"]
    assert result.divergence_cdf["t"].to_list() == [1, 2, 3, 4]
    assert set(result.accuracy["estimand"]) >= {"accuracy_x", "accuracy_y", "accuracy_drop"}
    assert result.accuracy_table.height == 1 and result.documents.height == 2
    assert result.generations.columns[:7] == [
        "action", "doc_id", "user_id", "line", "replicate", "tau", "timing"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "change,message",
    [
        ({"--actions": "snapkv@2.5"}, "--actions: actions.snapkv@2.5.budget"),
        ({"--actions": "lru@0.5"}, "--actions: actions.lru@0.5.selector: expected one of"),
        ({"--actions": "recent@0.5,recent@0.5"}, "--actions: action 'recent@0.5' given twice"),
        ({"--actions": "snapkv@0.5+window"}, "expected KEY=VALUE after '+'"),
        ({"--actions": "snapkv@0.5"}, "too short for the 64-token observation window"),
        ({"--K": "0"}, "--K: expected an integer >= 1"),
        ({"--H": "2"}, "--H: expected an integer >= 4"),
        ({"--metric": "bleu"}, "--metric: expected one of"),
        ({"--model": "/nonexistent/model"}, "--model"),
        ({"--prompts": "/nonexistent/p.jsonl"}, "p.jsonl: no such file"),
        ({"--baseline": "lru@0.5"}, "--baseline: actions.lru@0.5.selector: expected one of"),
        ({"--baseline": "recent@0.5"}, "--baseline: 'recent@0.5' is the only action; add"),
        ({"--temperature": "-1"}, "--temperature: expected a finite number >= 0 (0: greedy)"),
        ({"--actions": "a=recent@0.5,a=full"}, "--actions: label 'a' given twice"),
        (
            {"--actions": "no_such_mod:X@0.5"},
            "--actions: actions.no_such_mod:X@0.5.selector: cannot import module 'no_such_mod' "
            "(No module named 'no_such_mod') (looked in the current folder, PYTHONPATH and the "
            "installed packages)",
        ),
    ],
)
def test_bad_inputs_are_one_line(prompts, tmp_path, capsys, change, message):
    args = {"--model": str(MODEL), "--prompts": str(prompts), "--actions": "recent@0.5"}
    args |= {"--H": "4", "--out": str(tmp_path / "out")} | change
    argv = ["compare", *[x for kv in args.items() for x in kv]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvdiverge compare: ") and "\n" not in err, err
    assert message in err, err
    assert not (tmp_path / "out").exists()


def test_a_bad_prompts_line_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PROMPTS[0]) + "\n" + '{"prompt": "x"}\n')
    argv = ["compare", "--model", str(MODEL), "--prompts", str(bad), "--actions", "recent@0.5"]
    assert main(argv) == 2
    assert "bad.jsonl, line 2, field 'answers': missing" in capsys.readouterr().err


def test_action_items_parse_like_config_entries():
    snap, full = parse_action_list("snapkv@512+window=16+kernel=3,full")
    assert snap.as_dict()["budget"] == 512 and snap.window == 16 and snap.kernel == 3
    assert full.keeps_everything and full.name == "full"
    with pytest.raises(CompareError, match="expected comma-separated actions"):
        parse_action_list("snapkv@0.5,,full")


def test_help_lists_the_commands():
    out = subprocess.run(
        [sys.executable, "-m", "kvdiverge.cli", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "compare" in out.stdout


def test_the_researchers_comparison_from_the_selector_folder(prompts, tmp_path):
    """Issue 31's "Done when" command, by the console script from the folder holding the
    selector file, without PYTHONPATH: contrasts, summary, figures and generations.html in a
    fresh default folder, one line per step on standard error."""
    (tmp_path / "my_methods.py").write_text(SELECTOR)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = [str(Path(sys.executable).parent / "kvdiverge"), "compare", "--model", str(MODEL)]
    command += ["--baseline", "snapkv=snapkv@0.5+window=8"]
    command += ["--actions", "mine=my_methods:SinkStride@0.5,recent=recent@0.5"]
    command += ["--temperature", "0", "--prompts", str(prompts), "--H", "6", "--draws", "50"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    (folder,) = [p for p in tmp_path.iterdir() if p.name.startswith("kvdiverge-compare-")]
    printed = done.stdout.split()
    assert printed[:2] == [
        str(Path(folder.name) / "summary.md"),
        str(Path(folder.name) / "contrasts.csv"),
    ]
    err = done.stderr.strip().splitlines()
    assert err[0] == "temperature 0 (greedy): every replicate is the same path, so K = 1 (not 4)"
    assert (
        err[1].startswith("2 prompts from ")
        and "actions snapkv, mine, recent (baseline snapkv)" in err[1]
    )
    assert err[-1] == f"wrote {folder.name}" and not any("Traceback" in line for line in err)
    progress = [line.split(" [")[0] + " " + line.rsplit(" ", 2)[-2] for line in err if
                line.endswith(" done)")]  # fmt: skip
    assert progress == ["prompts: 1/2 'fox'", "prompts: 2/2 2"]
    assert "\r" not in done.stderr and any(line.startswith("decode steps: ") for line in err)
    contrasts = pl.read_csv(folder / "contrasts.csv")
    assert contrasts["action"].unique(maintain_order=True).to_list() == ["mine", "recent"]
    assert set(contrasts["baseline"]) == {"snapkv"} and contrasts.height == 2 * 10
    summary = (folder / "summary.md").read_text()
    assert "## mine against snapkv" in summary and "## recent against snapkv" in summary
    assert "greedy decoding" in summary
    for name in ("contrasts.png", "decomposition.png", "fig5_divergence_cdf.png", "accuracy.png"):
        assert (folder / name).stat().st_size > 10_000, name
    assert "<tr><th>mine</th>" in (folder / "generations.html").read_text()
    assert (folder / "trajectories" / "mine.parquet").exists()
    assert pl.read_csv(folder / "table1.csv")["action"].to_list() == ["snapkv", "mine", "recent"]


def test_the_python_api_takes_records_and_data_frames():
    by_list = compare(MODEL, PROMPTS, "recent@0.5", K=1, H=4, draws=10)
    same = [r | {"answers": [r["answers"]] if isinstance(r["answers"], str) else r["answers"]}
            for r in PROMPTS]  # fmt: skip
    by_frame = compare(MODEL, pl.DataFrame(same), "recent@0.5", K=1, H=4, draws=10)
    for result in (by_list, by_frame):
        gen = result.generations.sort("doc_id")
        assert gen["user_id"].to_list() == ["fox", None]
        assert gen["line"].to_list() == ["line 1", "line 2"]
    assert by_list.generations.equals(by_frame.generations)
    with pytest.raises(CompareError) as err:
        compare(MODEL, [PROMPTS[0], {"prompt": "x"}], "recent@0.5", H=4)
    assert str(err.value) == "prompts, record 2, field 'answers': missing"
    with pytest.raises(CompareError, match="^prompts: expected a .jsonl or .parquet path, a list"):
        compare(MODEL, 42, "recent@0.5", H=4)


def test_kvdiverge_compare_exits_2_with_the_line_and_writes_nothing(tmp_path, capsys):
    """The selector's one line (tests/eviction/test_user_selectors.py) reaches compare's user as
    ``kvdiverge compare: <line>``, exit status 2, nothing written."""
    prompts = tmp_path / "mine.jsonl"
    prompt = "The river flows north past the old mill. The magic number is 482913."
    record = {"prompt": prompt + " What is the magic number?", "answers": ["482913"]}
    prompts.write_text(json.dumps(record) + "\n")
    out = tmp_path / "out"
    actions = "mine=selector_helpers:Duplicates@0.5,recent@0.5"
    argv = ["compare", "--model", str(MODEL), "--prompts", str(prompts), "--actions", actions]
    assert main([*argv, "--K", "1", "--H", "4", "--draws", "20", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        "kvdiverge compare: action 'mine': selector 'selector_helpers:Duplicates': position 3 "
        "more than once at layer 0, KV head 0; expected distinct positions, exactly "
    ), err
    assert not out.exists() or not any(out.iterdir())
