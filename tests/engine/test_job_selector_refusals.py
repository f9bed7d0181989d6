"""A user's selector that breaks its contract or is not deterministic stops a rollout job
(kvdiverge.engine.rollout_job) before any decoding with one line naming the action and the
selector, and the job writes no trajectory; as a workflow script, its traceback goes to the log
and one line to the console. The selectors: tests/selector_helpers.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from refusal_helpers import one_line

from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job
from kvdiverge.eviction import ActionError

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
MODEL = ROOT / "data" / "models" / "tiny-llama"
DOCUMENTS = ROOT / "tests" / "data" / "documents" / "ruler-1024.parquet"


# ---- a rollout job: one line, nothing written ----------------------------------------------------
JOB_ACTIONS = {
    "full": {"selector": "full"},
    "recent-half": {"selector": "recent", "budget": 0.5},
    "mine": {"selector": "selector_helpers:Duplicates", "budget": 0.5},
}


JOB_COHORTS = {"full": {"dev": 1}, "recent-half": {"dev": 1}, "mine": {"dev": 1}}


def test_a_rollout_job_stops_before_decoding_and_writes_nothing(tmp_path):
    out = {name: tmp_path / "out" / f"{name}.parquet" for name in JOB_ACTIONS}
    model = {"name": "tiny-llama", "path": str(MODEL)}
    with pytest.raises(ActionError) as info:
        run_stratum_rollout_job(
            DOCUMENTS, out, model, JOB_ACTIONS, JOB_COHORTS, RolloutSettings(H=4, seed=1),
            device="cpu", resume_key="test",
        )  # fmt: skip
    assert one_line(info).startswith(
        "action 'mine': selector 'selector_helpers:Duplicates': position 3 more than once at "
        "layer 0, KV head 0; expected distinct positions, exactly "
    )
    assert not any(path.exists() for path in out.values())
    # no trajectory, no finished document in a scratch area (only the scratch areas' keys,
    # written when the job opens them)
    written = [p for p in (tmp_path / "out").rglob("*") if p.is_file() and p.name != "key.json"]
    assert written == []


def test_a_job_script_writes_the_traceback_to_its_log_and_one_line_to_the_console(tmp_path):
    """As a workflow script does (kvdiverge.pipeline.logs.job_log): the console gets the rule,
    the action's line and the log's path; the log gets the user's traceback."""
    log, out = tmp_path / "logs" / "job.log", tmp_path / "out" / "mine.parquet"
    script = textwrap.dedent(
        """
        import sys, types
        from kvdiverge.pipeline.logs import job_log
        snakemake = types.SimpleNamespace(log=[sys.argv[1]], output=[sys.argv[2]], rule="rollout")
        job_log(snakemake)
        from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job
        run_stratum_rollout_job(
            sys.argv[3], {"mine": sys.argv[2]}, {"name": "tiny-llama", "path": sys.argv[4]},
            {"mine": {"selector": "selector_helpers:Raises", "budget": 0.5}},
            {"mine": {"dev": 1}}, RolloutSettings(H=4, seed=1), device="cpu",
        )
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", script, str(log), str(out), str(DOCUMENTS), str(MODEL)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=300,
    )
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr == (
        "rollout: ActionError: action 'mine': selector 'selector_helpers:Raises': positions "
        f"raised ZeroDivisionError: integer division or modulo by zero (traceback in {log})\n"
    )
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "return 1 // 0" in text
    assert not out.exists()


def test_a_rollout_job_refuses_a_non_deterministic_selector_and_writes_nothing(tmp_path):
    """In the pipeline's rollout job: the first document's selection is made twice, before any
    decoding, and the difference stops the job (the job's process has not seen the selector)."""
    from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job

    documents = DOCUMENTS
    actions = {
        "full": {"selector": "full"},
        "mine": {"selector": "selector_helpers:Unseeded", "budget": 0.5},
    }
    cohorts = {"full": {"dev": 1}, "mine": {"dev": 1}}
    out = {name: tmp_path / "out" / f"{name}.parquet" for name in actions}
    model = {"name": "tiny-llama", "path": str(MODEL)}
    with pytest.raises(ActionError) as info:
        run_stratum_rollout_job(
            documents, out, model, actions, cohorts, RolloutSettings(H=4, seed=1),
            device="cpu", resume_key="test",
        )  # fmt: skip
    assert one_line(info).startswith(
        "action 'mine': selector 'selector_helpers:Unseeded': positions returned different kept "
        "positions when called twice"
    )
    written = [p for p in (tmp_path / "out").rglob("*") if p.is_file() and p.name != "key.json"]
    assert written == []
