"""Project conventions: ruff, the pinned snakefmt and snakemake's linter are clean."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: install the project's test extra")
    return found


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)


def test_ruff_clean():
    res = _run([_tool("ruff"), "check", "src", "tests", "workflow", "benchmarks"])
    assert res.returncode == 0, res.stdout + res.stderr


def test_snakefmt_clean():
    res = _run([_tool("snakefmt"), "--check", "Snakefile", "workflow/rules"])
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow
def test_snakemake_lint_clean():
    res = _run([_tool("snakemake"), "--lint", "--cores", "1"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Lints for" not in res.stdout + res.stderr
