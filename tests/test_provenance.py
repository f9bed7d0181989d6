"""Rerun fingerprints derived from imports (kvdiverge.provenance)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdiverge import provenance
from kvdiverge.provenance import PACKAGE, imported_modules, script_fingerprint

ROOT = Path(__file__).resolve().parents[1]


def test_real_scripts_reach_what_they_use_transitively():
    rollout = imported_modules([ROOT / "workflow" / "scripts" / "rollout.py"])
    # the script imports kvdiverge.engine, which gathers the three engine modules; the job
    # loads models and writes trajectories through function-level imports
    for name in ("kvdiverge.engine", "kvdiverge.decode", "kvdiverge.attention",
                 "kvdiverge.rollout_job", "kvdiverge.coupling", "kvdiverge.eviction",
                 "kvdiverge.models", "kvdiverge.trajectories", "kvdiverge"):  # fmt: skip
        assert name in rollout, name
    assert "kvdiverge.plots.study" not in rollout and "kvdiverge.tables" not in rollout
    stats = imported_modules([ROOT / "workflow" / "scripts" / "document_stats.py"])
    # reached through document_stats only: the control check and the risk definitions
    assert {"kvdiverge.analysis.control", "kvdiverge.risk", "kvdiverge.analysis"} <= set(stats)
    assert "kvdiverge.decode" not in stats


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package kvdiverge_fp_* is not importable by that name, so the test builds a small
    tree of its own and points PACKAGE at it."""
    root = tmp_path / "fp_pkg"
    (root / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from fp_pkg.sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from . import c\n    return c\n",
        "sub/c.py": "X = 1\n",
        "unrelated.py": "Y = 1\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    script = tmp_path / "script.py"
    script.write_text("import os\nfrom fp_pkg.a import *\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(provenance, "PACKAGE", "fp_pkg")
    provenance.module_file.cache_clear()
    yield root, script
    provenance.module_file.cache_clear()


def test_fingerprint_follows_imports_and_nothing_else(package):
    root, script = package
    assert imported_modules([script]) == [
        "fp_pkg",
        "fp_pkg.a",
        "fp_pkg.sub",
        "fp_pkg.sub.b",
        "fp_pkg.sub.c",  # a relative import inside a function
    ]
    before = script_fingerprint(script)
    (root / "unrelated.py").write_text("Y = 2\n")
    assert script_fingerprint(script) == before  # a module the script never reaches
    (root / "sub" / "c.py").write_text("X = 2\n")
    after = script_fingerprint(script)
    assert after != before  # reached through two imports
    (root / "sub" / "__init__.py").write_text("# runs before b\n")
    assert script_fingerprint(script) != after


def test_missing_entries_are_one_line_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no script"):
        script_fingerprint(tmp_path / "absent.py")
    with pytest.raises(ModuleNotFoundError, match="no module named 'kvdiverge.absent'"):
        script_fingerprint("kvdiverge.absent")
    assert PACKAGE == "kvdiverge"
