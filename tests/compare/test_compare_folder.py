"""``kvdiverge compare``'s output folder and file names (issue 27, items 3 and 7): labels and
parameter values never reach a path unescaped, a non-empty ``--out`` is refused unless
``--force``, which removes only what an earlier compare wrote there, a fresh default folder per
run, ``--out`` naming a file is one line; and a ``module:Class`` selector in the current folder
imports without PYTHONPATH."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import polars as pl
import pytest

from kvdiverge.cli import main
from kvdiverge.compare import CompareError, parse_actions, planned_files
from kvdiverge.compare.actions import path_name, split_items
from kvdiverge.compare.folder import MANIFEST, default_out

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "data" / "models" / "tiny-llama"
PROMPTS = [
    {"id": "fox", "prompt": "The fox keeps the number 1234567 in its den. Which number does the "
     "fox keep in its den, and why does it keep it there?", "answers": ["1234567"]},
    {"prompt": "The capital of the invented land Zorbia is Quell, a city by the sea. What is the "
     "capital of Zorbia?", "answers": "Quell"},
]  # fmt: skip
SELECTOR = """
from dataclasses import dataclass

import torch

from kvdiverge.eviction import ScoredSelector


@dataclass(frozen=True)
class SinkStride(ScoredSelector):
    sinks: int = 4
    tag: str = ""

    def always_kept(self, n):
        return range(self.sinks)

    def score(self, prefill, action, layer):
        n_kv, n = prefill.keys[layer].shape[:2]
        pos = torch.arange(n, dtype=torch.float32)
        return (((n - 1 - pos) % 2 == 0).float() * n + pos).expand(n_kv, n)
"""


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A folder holding the prompts and a selector module ``sel_<test>``, as the current folder;
    ``sys.path`` restored afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return tmp_path


def _argv(out: Path | None, actions: str, *extra: str) -> list[str]:
    argv = ["compare", "--model", str(MODEL), "--prompts", "prompts.jsonl", "--actions", actions]
    argv += ["--K", "1", "--H", "4", "--draws", "20", *extra]
    return argv + (["--out", str(out)] if out is not None else [])


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_path_names_escape_every_separator_and_dot():
    assert path_name("snapkv@0.5+window=8") == "snapkv@0.5+window=8"
    assert path_name("my_methods:SinkStride@0.5+tag=/../../x") == (
        "my_methods%3ASinkStride@0.5+tag=%2F..%2F..%2Fx"
    )
    assert path_name("..") == "%2E." and path_name(".hidden") == "%2Ehidden"
    assert path_name("a%2Fb") == "a%252Fb" != path_name("a/b") == "a%2Fb"
    assert path_name("C:\\x y") == "C%3A%5Cx%20y"
    long = path_name("x" * 300)
    assert len(long) == 120 and long != path_name("x" * 301)
    for label in ("..", "a/b", "../../etc", "/abs", "x" * 300):
        name = path_name(label)
        assert "/" not in name and "\\" not in name and name not in (".", "..")


def test_labels_name_the_actions():
    snap, mine = parse_actions("snapkv=snapkv@0.5+window=8,recent@0.5+sinks=2")
    assert (snap.label, snap.spec, snap.action.name) == ("snapkv", "snapkv@0.5+window=8", "snapkv")
    assert snap.action.window == 8
    assert (mine.label, mine.spec) == ("recent@0.5+sinks=2", "recent@0.5+sinks=2")


@pytest.mark.parametrize(
    "actions,message",
    [
        ("a=recent@0.5,a=snapkv@0.5", "--actions: label 'a' given twice"),
        ("=recent@0.5", "--actions: '=recent@0.5': expected LABEL=SPEC with a label before '='"),
        ("a=", "--actions: 'a=': expected an action after 'a='"),
        ("Mine=recent@0.5,mine=snapkv@0.5", "--actions: labels 'Mine' and 'mine' name the same"),
        (
            "a\tb=recent@0.5",
            "--actions label: expected a non-empty string of at most 40 printable characters, "
            "got 'a\\tb'",
        ),
        (
            "a - b=recent@0.5",
            "--actions label: expected a label without ' - ' (it separates the two actions of a "
            "contrast), got 'a - b'",
        ),
    ],
)
def test_bad_labels_are_one_line(actions, message):
    with pytest.raises(CompareError) as err:
        parse_actions(actions)
    assert str(err.value).startswith(message), str(err.value)


def test_parameter_values_and_labels_stay_inside_out(workdir, capsys):
    """``+tag=/../../x`` and a label ``../up`` reach no path unescaped; the selector file in the
    current folder imports without PYTHONPATH."""
    (workdir / "sel_escape.py").write_text(SELECTOR)
    out = workdir / "deep" / "out"
    actions = "sel_escape:SinkStride@0.5+tag=/../../x,../up=recent@0.5"
    assert main(_argv(out, actions)) == 0, capsys.readouterr().err
    outside = {str(p.relative_to(workdir)) for p in workdir.rglob("*") if p.is_file()}
    outside = {p for p in outside if not p.startswith("deep/out/")}
    assert outside <= {"prompts.jsonl", "sel_escape.py"} | {
        p for p in outside if p.startswith("__pycache__/")
    }
    written = _files(out)
    assert "trajectories/sel_escape%3ASinkStride@0.5+tag=%2F..%2F..%2Fx.parquet" in written
    assert "trajectories/%2E.%2Fup.parquet" in written
    table1 = pl.read_csv(out / "table1.csv")
    assert table1["action"].to_list() == ["sel_escape:SinkStride@0.5+tag=/../../x", "../up"]
    manifest = json.loads((out / MANIFEST).read_text())
    assert set(manifest["files"]) == written - {MANIFEST}
    assert manifest["files"] == sorted(planned_files(parse_actions(actions), None))


def test_out_naming_a_file_is_one_line(workdir, capsys):
    target = workdir / "results.txt"
    target.write_text("mine")
    assert main(_argv(target, "recent@0.5")) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"kvdiverge compare: --out: {target} is a file; expected a folder (new or from compare)"
    )
    assert target.read_text() == "mine"


def test_a_non_empty_out_needs_force_and_force_keeps_foreign_files(workdir, capsys):
    out = workdir / "out"
    assert main(_argv(out, "a=recent@0.5,b=snapkv@0.5+window=8")) == 0
    first = _files(out)
    assert "trajectories/b.parquet" in first
    (out / "notes.txt").write_text("my notes")
    (out / "trajectories" / "mine.txt").write_text("keep")
    before = {p: (out / p).stat().st_mtime_ns for p in _files(out)}
    capsys.readouterr()

    assert main(_argv(out, "a=recent@0.5")) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"kvdiverge compare: --out: {out} is not empty; pass --force to replace what an earlier "
        "kvdiverge compare wrote there (nothing else is removed), or name a new folder"
    )
    assert {p: (out / p).stat().st_mtime_ns for p in _files(out)} == before

    assert main([*_argv(out, "a=recent@0.5"), "--force"]) == 0
    after = _files(out)
    assert "trajectories/b.parquet" not in after  # the earlier run's own file, removed
    assert {"notes.txt", "trajectories/mine.txt"} <= after  # foreign files kept
    assert (out / "notes.txt").read_text() == "my notes"
    assert pl.read_csv(out / "table1.csv")["action"].to_list() == ["a"]
    manifest = json.loads((out / MANIFEST).read_text())["files"]
    assert "trajectories/b.parquet" not in manifest and "notes.txt" not in manifest


def test_force_refuses_to_replace_a_foreign_file(workdir, capsys):
    out = workdir / "out"
    out.mkdir()
    (out / "estimands.csv").write_text("my own table")
    assert main([*_argv(out, "recent@0.5"), "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"kvdiverge compare: --out: {out / 'estimands.csv'} was not written by kvdiverge compare "
        f"(not in {MANIFEST}); --force replaces only compare's own files: move it or name another "
        "folder"
    )
    assert (
        _files(out) == {"estimands.csv"} and (out / "estimands.csv").read_text() == "my own table"
    )


def test_a_broken_manifest_is_one_line(workdir, capsys):
    out = workdir / "out"
    out.mkdir()
    (out / MANIFEST).write_text(json.dumps({"files": ["../../etc/passwd"]}))
    assert main([*_argv(out, "recent@0.5"), "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"kvdiverge compare: --out: {out / MANIFEST} lists '../../etc/passwd', not a file inside "
        "the folder; remove the manifest or name another folder"
    )


def test_the_default_folder_is_fresh_per_run(workdir, capsys):
    first = default_out(workdir, now=0)
    assert first.name == "kvdiverge-compare-19700101-000000"
    first.mkdir()
    assert default_out(workdir, now=0).name == "kvdiverge-compare-19700101-000000-2"
    assert main(_argv(None, "recent@0.5")) == 0
    assert main(_argv(None, "recent@0.5")) == 0
    runs = sorted(p.name for p in workdir.iterdir() if p.name.startswith("kvdiverge-compare-2"))
    assert len(runs) == 2 and runs[0] != runs[1], runs
    for run in runs:
        assert "trajectories/recent@0.5.parquet" in _files(workdir / run)


def test_parameter_values_may_be_mappings_and_a_misspelt_press_gets_a_suggestion():
    pytest.importorskip("kvpress")
    text = 'k=kvpress@0.5+press=StreamingLLMPress+press_kwargs={"n_sink": 8},full'
    k, full = parse_actions(text)
    assert k.label == "k" and k.action.params["press_kwargs"] == {"n_sink": 8}
    assert split_items("a+b={x: [1, 2], y: '3,4'},c") == ["a+b={x: [1, 2], y: '3,4'}", "c"]
    assert full.label == "full"
    with pytest.raises(CompareError) as err:
        parse_actions("kvpress@0.5+press=KnormPres")
    assert str(err.value).endswith("got 'KnormPres'; did you mean 'KnormPress'?")


def test_parsed_actions_are_taken_as_they_are():
    from kvdiverge.eviction import parse_action

    mine = parse_action({"selector": "recent", "budget": 0.5, "sinks": 2}, name="mine")
    (only,) = parse_actions([mine])
    assert only.label == "mine" and only.action is mine
    with pytest.raises(CompareError, match="expected action texts or ActionSpec objects, got 3"):
        parse_actions([mine, 3])
