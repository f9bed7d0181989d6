"""``kvdiverge compare``'s generations side by side (issue 31, item 3): ``generations.parquet``
holds τ, the user's id and line, the shared prefix and both continuations, consistent with the
trajectory files; ``generations.html`` shows them with the divergence token marked, checked in
headless Chromium when it is installed."""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from browser_helpers import CHROMIUM, has_colour, render_in_chromium

from kvdiverge.compare import compare
from kvdiverge.io.trajectories import read_trajectories

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "data" / "models" / "tiny-llama"
PROMPTS = [
    {"id": "fox", "prompt": "One of the special magic numbers for red-fox is: 1234567. Remember "
     "it. What is the special magic number for red-fox?", "answers": ["1234567"]},
    {"prompt": "The capital of the invented land Zorbia is Quell, a city by the sea. What is the "
     "capital of Zorbia? Answer <b>briefly</b> & clearly.", "answers": "Quell"},
]  # fmt: skip
ACTIONS = ["snapkv=snapkv@0.5+window=8", "recent=recent@0.5"]
H, K = 8, 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("generations")
    prompts = root / "mine.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    out = root / "out"
    result = compare(MODEL, prompts, ACTIONS, K=K, H=H, draws=20, seed=4, out=out)
    return result, out


def test_generations_table_is_consistent_with_the_trajectories(run):
    result, out = run
    gen = pl.read_parquet(out / "generations.parquet")
    assert gen.equals(result.generations)
    assert gen.height == 2 * len(PROMPTS) * K
    for col in ("tau", "user_id", "line", "prefix", "x_continuation", "y_continuation", "delta"):
        assert col in gen.columns
    first = gen.filter(pl.col("doc_id") == "custom-prompts/study1/000")
    second = gen.filter(pl.col("doc_id") == "custom-prompts/study1/001")
    assert set(first["user_id"]) == {"fox"} and set(first["line"]) == {"line 1"}
    assert second["user_id"].null_count() == second.height and set(second["line"]) == {"line 2"}
    for action in ("snapkv", "recent"):
        traj = read_trajectories(out / "trajectories" / f"{action}.parquet").sort(
            "doc_id", "replicate", "t"
        )
        mism = traj["mismatch"].to_numpy().reshape(-1, H)
        tau = [int(m.argmax()) + 1 if m.any() else None for m in mism]
        rows = gen.filter(pl.col("action") == action).sort("doc_id", "replicate")
        assert rows["tau"].to_list() == tau
        delta = traj["tv_rollout"].to_numpy().reshape(-1, H)
        np.testing.assert_allclose(np.array(rows["delta"].to_list()), delta, rtol=1e-6)
        for r in rows.iter_rows(named=True):
            assert r["prefix"] + r["x_continuation"] == r["x_text"]
            if r["tau"] is None:
                assert r["x_text"] == r["y_text"] and r["timing"] == "never"
                assert r["x_continuation"] == r["y_continuation"] == ""
            else:
                assert r["y_text"].startswith(r["prefix"])
                assert r["prefix"] + r["y_continuation"] == r["y_text"]


def test_generations_page_shows_each_prompt_and_action(run):
    result, out = run
    page = (out / "generations.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "<h2>Prompt id &#x27;fox&#x27;, line 1</h2>" in page
    assert "<h2>Prompt line 2</h2>" in page
    assert html.escape(PROMPTS[1]["prompt"]) in page and "<b>briefly</b>" not in page
    assert page.count("<tr><th>snapkv</th>") == 2 and page.count("<tr><th>recent</th>") == 2
    diverged = result.generations.filter(pl.col("tau").is_not_null())
    shown = diverged.group_by("action", "doc_id").len().height
    assert page.count('<span class="div">') == 2 * shown  # X's and Y's divergence token
    for r in diverged.iter_rows(named=True):
        assert f"τ = {r['tau']}" in page or r["replicate"] > 0


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed")
def test_generations_page_renders_in_headless_chromium(run, tmp_path):
    _, out = run
    dom, pixels = render_in_chromium(out / "generations.html", tmp_path)
    assert 'class="gen x"' in dom and 'class="div"' in dom
    assert "Prompt id 'fox', line 1" in dom
    # the page is drawn: the divergence marks' blue and vermillion backgrounds are on it
    assert has_colour(pixels, (0xCF, 0xE3, 0xF7)) and has_colour(pixels, (0xFB, 0xD9, 0xC3))
