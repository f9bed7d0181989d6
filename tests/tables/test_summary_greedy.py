"""The estimands summary under greedy decoding states once the identities that hold at T = 0
(S_.99 = R = R_SMC, one path per document), and only then; the identities checked against a
greedy run's own estimands."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from kvdiverge.tables import read_estimands, write_estimands_summary
from kvdiverge.tables.contrasts import GREEDY_NOTE

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "data" / "models" / "tiny-llama"
PROMPT = "The river flows north past the old mill and the stone bridge. " * 3


@pytest.fixture(scope="module")
def greedy_estimands(tmp_path_factory):
    """estimands.csv of a greedy compare run (the tiny model, two prompts, two actions)."""
    from kvdiverge.compare import compare

    folder = tmp_path_factory.mktemp("greedy")
    prompts = folder / "p.jsonl"
    records = [{"prompt": PROMPT + str(i), "answers": ["mill"]} for i in range(2)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    actions = ["recent@0.25", "snapkv@0.25+window=16"]
    compare(MODEL, prompts, actions, K=1, H=6, draws=10, temperature=0, out=folder / "out",
            quiet=True)  # fmt: skip
    return folder / "out" / "estimands.csv"


def _pages(path: Path, folder: Path, temperature: float | None):
    files = [folder / n for n in ("estimands.parquet", "summary.md", "summary.html")]
    summary = write_estimands_summary(path, *files, study="s", temperature=temperature)
    return summary, files[1].read_text(), files[2].read_text()


def test_the_greedy_note_is_stated_once_under_greedy_decoding(greedy_estimands, tmp_path):
    summary, markdown, html = _pages(greedy_estimands, tmp_path, 0)
    assert summary.facts.count(GREEDY_NOTE) == 1
    assert markdown.count(GREEDY_NOTE) == 1
    assert html.count("every next-token law is a point mass") == 1
    assert "S_.99 and R then equal R_SMC" in markdown and "(K = 1)" in markdown


@pytest.mark.parametrize("temperature", [None, 1.0, 0.7])
def test_no_greedy_note_otherwise(greedy_estimands, tmp_path, temperature):
    summary, markdown, html = _pages(greedy_estimands, tmp_path, temperature)
    assert GREEDY_NOTE not in summary.facts
    assert "point mass" not in markdown and "point mass" not in html


def test_the_note_is_true_of_the_greedy_estimands(greedy_estimands):
    """What the note says, on the run's own rows: per action and stratum, S_.99, R and R_SMC
    are the same number, and every document has one path."""
    table = read_estimands(greedy_estimands).filter(pl.col("contrast") == "")
    wide = table.filter(pl.col("estimand").is_in(["S_99", "R", "R_smc"])).pivot(
        on="estimand", index=["action", "stratum"], values="value"
    )
    assert wide.height >= 3  # the full cache and two actions, pooled at least
    for row in wide.iter_rows(named=True):
        assert row["S_99"] == pytest.approx(row["R"], abs=1e-12)
        assert row["R"] == pytest.approx(row["R_smc"], abs=1e-12)
    rows = table.filter(pl.col("estimand") == "R_smc")
    assert (rows["n_paths"] == rows["n_docs"]).all()
