"""A partial run (`--until`, `--omit-from`, explicit targets, `--allowed-rules`) whose jobs
succeed exits 0, builds no report and says how to build it (docs/running.md, "The report"; the
decision itself: tests/workflow/test_report.py). Before, `--until` ran the report builder, which
failed on the missing results, and the run exited 1."""

from __future__ import annotations

import pytest
import yaml
from workflow_helpers import planned_jobs, run_snakemake, workflow_copy

SMALL = {
    "finite_state": {
        "n_systems": 3,
        "horizon": 8,
        "n_states": 3,
        "n_tokens": 4,
        "alt_strength": 0.3,
        "n_reps": 1500,
        "window_depths": [1, 2, 8],
        "interval_figure_systems": [0, 2],
    }
}
SKIPPED = "Report skipped: a partial run ({}) builds no report."
BUILD = "build results/report.html with `snakemake --report results/report.html --configfile"


@pytest.mark.slow
def test_partial_runs_exit_zero_and_say_how_to_build_the_report(tmp_path):
    work = workflow_copy(tmp_path)
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump(SMALL))
    config = ("--configfile", str(small))

    res = run_snakemake(work, "--until", "finite_state_systems", *config)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-3000:]
    assert planned_jobs(res) == {"finite_state_systems": 1}
    assert SKIPPED.format("--until finite_state_systems") in text
    assert f"{BUILD} config.yaml ../small.yaml`." in text  # config.yaml, which it extends, first
    assert not (work / "results" / "report.html").exists()

    figure = "results/finite_state/figures/estimators.png"
    res = run_snakemake(work, figure, "--allowed-rules", "finite_state_figures", *config)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-3000:]
    assert planned_jobs(res) == {"finite_state_figures": 1}
    assert SKIPPED.format(f"the targets {figure}, --allowed-rules finite_state_figures") in text
    assert not (work / "results" / "report.html").exists()

    res = run_snakemake(
        work, "results/finite_state/systems.csv", "--omit-from", "finite_state_figures", "-F",
        *config,
    )  # fmt: skip
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-3000:]
    assert (
        SKIPPED.format(
            "the targets results/finite_state/systems.csv, --omit-from finite_state_figures"
        )
        in text
    )
    assert not (work / "results" / "report.html").exists()
