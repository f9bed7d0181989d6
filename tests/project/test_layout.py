"""The package's layers (docs/architecture.md, "Layout"): each subpackage imports only the
layers below it, no module imports in a circle, no module is much over 600 lines, and the
workflow scripts' rerun fingerprints reach only what their stage needs (a rollout job reruns
for no analysis edit; the SWRB estimands job loads no torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvdiverge.pipeline.provenance import direct_imports, imported_modules, module_file

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "src" / "kvdiverge"
SCRIPTS = ROOT / "workflow" / "scripts"

LAYERS = (
    "theory",
    "io",
    "pipeline",
    "datasets",
    "eviction",
    "models",
    "engine",
    "analysis",
    "tables",
    "plots",
    "config",
    "compare",
    "cli",
)
"""Bottom to top: a module may import its own layer and those before it."""

MAX_LINES = 620
ANALYSIS = ("kvdiverge.analysis", "kvdiverge.tables", "kvdiverge.plots", "kvdiverge.config")
ENGINE = ("kvdiverge.engine", "kvdiverge.eviction", "kvdiverge.models")


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (packages by their ``__init__``)."""
    out = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def layer(name: str) -> int:
    """The rank of a module's layer; the package's own ``__init__`` (the version) is below all."""
    parts = name.split(".")
    return -1 if len(parts) == 1 else LAYERS.index(parts[1])


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {
        name: {m for m in direct_imports(path, name) if m in modules and m != name}
        for name, path in modules.items()
    }


def test_every_module_belongs_to_a_layer():
    for name in package_modules():
        layer(name)  # ValueError for a module outside LAYERS


def test_no_import_runs_up_the_layers():
    up = [
        f"{name} -> {dep}"
        for name, deps in import_graph().items()
        for dep in deps
        if layer(dep) > layer(name)
    ]
    assert not up, up


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (a list of modules, the first repeated at the end)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle():
    # a package's __init__ gathering its own modules is not a circle: leave those arrows out
    graph = {
        name: {d for d in deps if not d.startswith(name + ".")}
        for name, deps in import_graph().items()
    }
    assert find_cycle(graph) is None, find_cycle(graph)


def test_the_circle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_is_much_over_600_lines():
    long = {
        name: n
        for name, path in package_modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


@pytest.mark.parametrize("script", ["rollout.py", "swrb_rollout.py"])
def test_rollout_scripts_reach_no_analysis_code(script):
    reached = imported_modules([SCRIPTS / script])
    assert not [m for m in reached if m.startswith(ANALYSIS)], reached
    # what a rollout needs, so that the test cannot pass on an empty answer
    for needed in ("kvdiverge.engine.rows", "kvdiverge.eviction.selectors", "kvdiverge.io.locks"):
        assert needed in reached, needed


@pytest.mark.parametrize(
    "script",
    [
        "document_stats.py",
        "estimands.py",
        "prediction.py",
        "plan_sample_sizes.py",
        "study_tables.py",
        "study_figures.py",
        "study_sweep_figure.py",
        "swrb_estimands.py",
        "finite_state_systems.py",
        "finite_state_figures.py",
    ],
)
def test_analysis_scripts_reach_no_engine(script):
    reached = imported_modules([SCRIPTS / script])
    assert not [m for m in reached if m.startswith(ENGINE)], reached
    assert "kvdiverge.pipeline.logs" in reached


def test_the_swrb_estimands_job_imports_no_torch():
    """Import every module the SWRB estimands script reaches, in a fresh interpreter."""
    reached = [
        m for m in imported_modules([SCRIPTS / "swrb_estimands.py"]) if module_file(m) is not None
    ]
    assert "kvdiverge.analysis.swrb" in reached
    code = (
        "import importlib, sys\n"
        f"for name in {reached!r}:\n"
        "    importlib.import_module(name)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr
