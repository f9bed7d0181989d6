"""docs/cpu-study/README.md is written from the committed files of one run only: regenerating
it from those files gives the committed page, and the run's locks register the draws that each
interval level needs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "docs" / "cpu-study"


def test_the_page_is_what_make_readme_writes_from_the_committed_files():
    done = subprocess.run(
        [sys.executable, str(HERE / "make_readme.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_committed_configs_have_the_values_the_run_used():
    page = (HERE / "README.md").read_text(encoding="utf-8")
    assert "DIFFERENT FROM" not in page
    assert page.count("has values equal to the run's copy") == 2


def test_every_interval_has_at_least_50_draws_in_each_tail():
    for study in ("study1", "study2"):
        table = pl.read_csv(HERE / study / "estimands.csv", infer_schema_length=None)
        rows = table.filter(pl.col("ci_low").is_not_null()).select("ci_level", "draws").unique()
        assert rows.height > 0
        for level, draws in rows.iter_rows():
            assert draws * (1 - level) / 2 >= 50 - 1e-9, (study, level, draws)
        lock = json.loads((HERE / study / "lock.json").read_text())
        assert lock["design"]["K"] >= 1
    widest = pl.read_csv(HERE / "study2" / "estimands.csv", infer_schema_length=None)
    assert math.isclose(widest["ci_level"].max(), 0.99375)
