"""What a default `snakemake` run prints for its target: rule all is one line (its `message:`),
never its inputs, and the workflow profile's `quiet: [reason]` keeps the per-job reason lines
(which would list every final output for rule all) out; `--quiet host` brings them back, and a
dry run still ends with the reasons by rule."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from workflow_helpers import SNAKEMAKE, workflow_copy


def _dry_run(work: Path, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [SNAKEMAKE, "-n", "--cores", "1", *args],  # the profile profiles/default, as a user's
        cwd=work,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


@pytest.mark.slow
def test_rule_all_is_one_line_and_no_reason_lists_the_outputs(tmp_path):
    work = workflow_copy(tmp_path)
    text = _dry_run(work)
    lines = [line for line in text.splitlines() if "rule all" in line or "localrule all" in line]
    assert len(lines) == 1, lines
    match = re.fullmatch(r"Job 0: rule all: the (\d+) final outputs under results/", lines[0])
    assert match and int(match.group(1)) > 20, lines[0]
    assert "Reason:" not in text and "    reason:" not in text
    assert "Reasons:" in text  # the dry run's summary by rule stays
    again = _dry_run(work, "--quiet", "host")  # the per-job reasons, when wanted
    assert "Reason: Input files updated by another job: results/" in again
    assert again.count("    reason: ") > 10
