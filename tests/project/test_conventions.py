"""Project conventions: ruff, the pinned snakefmt and snakemake's linter are clean, and every
reference resolves inside the repository."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


# Documents a user of the project does not have: the sibling folder beside the checkout, and the
# section numbers of the spec, design and paper documents kept there. References go to
# docs/method.md and docs/architecture.md instead (by section heading).
_OUTSIDE_REFERENCE = re.compile(r"\.\./shared|(?:SPEC|DESIGN|paper)\s+§|reference/datasets\.md")
_REFERENCE_SUFFIXES = {".py", ".smk", ".rst", ".md", ".yaml", ".yml"}


def test_references_resolve_inside_the_repository():
    res = _run(["git", "ls-files", "-z"])
    if res.returncode != 0:
        pytest.skip("not a git checkout")
    found = []
    for name in res.stdout.split("\0"):
        path = ROOT / name
        if not path.is_file():
            continue
        if path.suffix not in _REFERENCE_SUFFIXES and path.name != "Snakefile":
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in _OUTSIDE_REFERENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{name}:{line}: {match.group(0)}")
    assert not found, "references outside the repository:\n" + "\n".join(found)
