"""End to end: the finite-state target of the Snakemake pipeline."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml
from workflow_helpers import run_snakemake, workflow_copy

ROOT = Path(__file__).resolve().parents[2]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
SYSTEMS_COLUMNS = (
    "system, lambda_scale, H, n_states, n_reps, exact_R, exact_O, exact_Pi, naive_mean, "
    "naive_var, swrb_mean, swrb_var, var_ratio, naive_cost, swrb_cost, advantage"
).split(", ")
FIGURES = [
    f"results/finite_state/figures/{name}.{ext}"
    for name in ("estimators", "identified_interval")
    for ext in ("png", "pdf")
]
SMALL = {
    "n_systems": 3,
    "horizon": 8,
    "n_states": 3,
    "n_tokens": 4,
    "alt_strength": 0.3,
    "n_reps": 1500,
    "window_depths": [1, 2, 8],
    "interval_figure_systems": [0, 2],
}


@pytest.mark.slow
def test_finite_state_target_runs(tmp_path):
    work = workflow_copy(tmp_path)
    override = tmp_path / "small.yaml"
    override.write_text(yaml.safe_dump({"finite_state": SMALL}))
    targets = ["results/finite_state/systems.csv", *FIGURES]
    res = run_snakemake(work, *targets, "--configfile", str(override), "--config", "seed=7")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    systems = pl.read_csv(work / "results/finite_state/systems.csv")
    assert systems.columns == SYSTEMS_COLUMNS
    assert systems.height == SMALL["n_systems"]
    assert systems["H"].to_list() == [8, 8, 8]
    assert systems["n_reps"].to_list() == [1500] * 3
    assert (systems["swrb_var"] < systems["naive_var"]).all()
    se = np.sqrt(systems["swrb_var"] / systems["n_reps"])
    assert (np.abs(systems["swrb_mean"] - systems["exact_R"]) <= 4 * se).all()
    windows = pl.read_csv(work / "results/finite_state/windows.csv")
    assert sorted(set(windows["L"].to_list())) == SMALL["window_depths"]
    for path in FIGURES:
        assert (work / path).stat().st_size > 5000, path
    assert (work / "results/logs/finite_state/systems.log").read_text().count("system ") >= 3
    for rule in ("finite_state_systems", "finite_state_figures"):
        assert list((work / "results/benchmarks" / rule).glob("*.tsv")), rule
    # up to date: a second run does nothing
    again = run_snakemake(work, "-n", *targets, "--configfile", str(override), "--config", "seed=7")
    assert "Nothing to be done" in again.stdout + again.stderr


@pytest.mark.slow
def test_snakemake_rejects_bad_finite_state_config(tmp_path):
    work = workflow_copy(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"finite_state": {"horizon": 0}}))
    res = run_snakemake(work, "-n", "results/finite_state/systems.csv", "--configfile", str(bad))
    assert res.returncode != 0
    assert "config.finite_state.horizon: expected a value >= 1, got 0" in res.stdout + res.stderr
