"""Rerun fingerprints derived from imports (kvdiverge.pipeline.provenance)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from kvdiverge.pipeline import provenance
from kvdiverge.pipeline.provenance import (
    PACKAGE,
    code_text,
    imported_modules,
    module_fingerprint,
    script_fingerprint,
)

ROOT = Path(__file__).resolve().parents[2]


def test_real_scripts_reach_what_they_use_transitively():
    rollout = imported_modules([ROOT / "workflow" / "scripts" / "rollout.py"])
    # the script imports kvdiverge.engine, which gathers the three engine modules; the job
    # loads models and writes trajectories through function-level imports
    for name in ("kvdiverge.engine", "kvdiverge.engine.rows", "kvdiverge.engine.attention",
                 "kvdiverge.engine.rollout_job", "kvdiverge.theory.coupling", "kvdiverge.eviction",
                 "kvdiverge.models", "kvdiverge.io.trajectories", "kvdiverge"):  # fmt: skip
        assert name in rollout, name
    assert "kvdiverge.plots.study" not in rollout and "kvdiverge.tables" not in rollout
    stats = imported_modules([ROOT / "workflow" / "scripts" / "document_stats.py"])
    # reached through document_stats only: the control check and the risk definitions
    assert {"kvdiverge.analysis.control", "kvdiverge.theory.risk", "kvdiverge.analysis"} <= set(
        stats
    )
    assert "kvdiverge.engine.rows" not in stats


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
    (root / "sub" / "__init__.py").write_text("RUNS_BEFORE_B = 1\n")
    assert script_fingerprint(script) != after


def test_missing_entries_are_one_line_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no script"):
        script_fingerprint(tmp_path / "absent.py")
    with pytest.raises(ModuleNotFoundError, match="no module named 'kvdiverge.absent'"):
        script_fingerprint("kvdiverge.absent")
    assert PACKAGE == "kvdiverge"


def test_module_fingerprint_tracks_code_not_docs(tmp_path, monkeypatch):
    # the package name is shared with the fixture above on purpose: whichever runs first in a
    # worker must not change what the other finds (modules are located without importing)
    provenance.module_file.cache_clear()
    pkg = tmp_path / "fp_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text('"""Doc."""\n\nX = 1  # one\n')
    (pkg / "b.py").write_text("Y = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fa, fb, fall = (
        module_fingerprint("fp_pkg.a"),
        module_fingerprint("fp_pkg.b"),
        module_fingerprint("fp_pkg"),
    )
    # docstrings, comments and blank lines are not code
    (pkg / "a.py").write_text('"""Another\ndoc (τ)."""\n# a comment\n\n\nX = 1  # uno\n')
    assert module_fingerprint("fp_pkg.a") == fa
    (pkg / "a.py").write_text('"""Doc."""\n\nX = 2  # one\n')
    assert module_fingerprint("fp_pkg.a") != fa
    assert module_fingerprint("fp_pkg.b") == fb
    assert module_fingerprint("fp_pkg") != fall
    (pkg / "a.py").write_text('"""Doc."""\n\nX = "1  # one"\n')  # a string, not a comment
    assert module_fingerprint("fp_pkg.a") != fa
    with pytest.raises(ModuleNotFoundError, match="no module named 'fp_pkg.missing'"):
        module_fingerprint("fp_pkg.missing")
    importlib.import_module("fp_pkg.a")  # a stale fp_pkg in sys.modules, as another test leaves it
    provenance.module_file.cache_clear()


def test_code_text_keeps_code_and_drops_docs_exactly():
    source = (
        '"""Module doc."""\n'
        "import os  # why\n"
        "# a whole-line comment\n"
        "\n"
        "class A:\n"
        '    """Class\n'
        '    doc (τ)."""\n'
        '    x = "#kept"  # dropped\n'
        "    def f(self):\n"
        "        'f doc'\n"
        "        return 1   \n"
        'def g(): "shares a line with code"; return 2\n'
    )
    assert code_text(source) == (
        "import os\n"
        "class A:\n"
        '    x = "#kept"\n'
        "    def f(self):\n"
        "        return 1\n"
        'def g(): "shares a line with code"; return 2\n'
    )


def test_rollout_fingerprint_covers_only_the_selectors_used(package):
    """A rollout job names its selectors: another selector's edit, or a new one, changes
    nothing; its own selector's edit, the shared machinery's, or a selector of one's own
    outside the package (its whole module) changes it."""
    root, script = package
    (root / "a.py").write_text(
        "from fp_pkg.sub import b\n"
        "def register_selector(cls):\n    return cls\n"
        "def shared():\n    return 0\n"
        "@register_selector\nclass Recent:\n    n = 1\n"
        "@register_selector\nclass Snap:\n    n = 2\n"
    )
    own = root.parent / "my_methods.py"
    own.write_text("def helper():\n    return 1\nclass Mine:\n    n = helper()\n")
    fp = lambda *sel: script_fingerprint(script, selectors=sel)  # noqa: E731
    recent, snap = fp("fp_pkg.a:Recent"), fp("fp_pkg.a:Snap")
    assert recent != snap != fp()
    text = (root / "a.py").read_text()
    (root / "a.py").write_text(text.replace("n = 2", "n = 3"))  # edit Snap
    assert fp("fp_pkg.a:Recent") == recent and fp("fp_pkg.a:Snap") != snap
    (root / "a.py").write_text(text + "@register_selector\nclass New:\n    n = 4\n")  # add one
    assert fp("fp_pkg.a:Recent") == recent and fp("fp_pkg.a:Snap") == snap
    (root / "a.py").write_text(text.replace("return 0", "return 5"))  # the shared machinery
    assert fp("fp_pkg.a:Recent") != recent
    (root / "a.py").write_text(text)
    mine = fp("fp_pkg.a:Recent", "my_methods:Mine")
    own.write_text("def helper():\n    return 2\nclass Mine:\n    n = helper()\n")
    assert fp("fp_pkg.a:Recent", "my_methods:Mine") != mine
    assert fp("fp_pkg.a:Recent") == recent
    with pytest.raises(LookupError, match="has no class 'Absent'"):
        fp("fp_pkg.a:Absent")
    with pytest.raises(ModuleNotFoundError, match="no module named 'nowhere'"):
        fp("nowhere:X")


def test_source_analyses_are_cached_across_processes_by_content(tmp_path):
    """The on-disk cache (KVDIVERGE_CACHE) gives the same fingerprints cold, warm and after
    its file is corrupted, and a source that changes is analysed anew."""
    import json
    import os
    import subprocess
    import sys

    cache = tmp_path / "cache"
    module = tmp_path / "fp_cached.py"
    module.write_text("import kvdiverge.analysis.groups\nx = 1  # one\n")
    probe = (
        "import sys; from kvdiverge.pipeline.provenance import code_text, script_fingerprint; "
        "print(script_fingerprint(sys.argv[1]), repr(code_text(open(sys.argv[1]).read())))"
    )

    def run() -> str:
        env = {**os.environ, "KVDIVERGE_CACHE": str(cache)}
        args = [sys.executable, "-c", probe, str(module)]
        return subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout

    cold = run()
    files = list(cache.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())  # written at exit
    assert run() == cold  # warm
    files[0].write_text("{not json")
    assert run() == cold  # a corrupt file is ignored and rewritten
    assert json.loads(files[0].read_text())
    module.write_text("import kvdiverge.analysis.groups\nx = 2  # one\n")
    changed = run()
    assert changed != cold and "x = 2" in changed
