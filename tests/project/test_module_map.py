"""The docs and the package agree: `docs/architecture.md`'s module map ("## Modules") names every
module of the package and no module that is not there; every qualified name the architecture
cites (``kvdiverge.x.y.name``) exists where it says; every package's ``__init__`` docstring
names its modules, at every depth, and its ``__all__`` holds only names it has; a module name
used in two packages is named by each namesake's docstring; no code comment or docstring
under ``src/`` carries an issue number."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "src" / "kvdiverge"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
FILE_SUFFIXES = (".c", ".md", ".py", ".json", ".csv", ".png", ".pdf", ".yaml", ".html", ".parquet")


def package_modules() -> dict[str, Path]:
    """Every module by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def subpackages() -> list[str]:
    return sorted(p.parent.name for p in PACKAGE_DIR.glob("*/__init__.py"))


def modules_section() -> str:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    start = text.index("\n## Modules\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def mapped_modules(section: str) -> set[str]:
    """The modules the map names: every backticked path under a top-level module (``engine/
    kernels/registry``, ``tables.inputs``, ``datasets/__init__``), and a bullet's leading bare
    name (``- `io` —``)."""
    tops = set(subpackages()) | {p.stem for p in PACKAGE_DIR.glob("*.py") if p.stem != "__init__"}
    found = set()
    for token in re.findall(r"`([A-Za-z_][\w./]*)`", section):
        if token.endswith(FILE_SUFFIXES) or not re.search(r"[/.]", token):
            continue
        parts = re.split(r"[/.]", token)
        if parts[0] not in tops:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found.add(".".join(["kvdiverge", *parts]))
    for token in re.findall(r"^- `([A-Za-z_]\w*)`", section, flags=re.M):
        found.add("kvdiverge" if token == "__init__" else f"kvdiverge.{token}")
    return found


def test_the_module_map_names_every_module_and_only_modules():
    modules = set(package_modules())
    mapped = mapped_modules(modules_section())
    assert not (modules - mapped), f"modules missing from the map: {sorted(modules - mapped)}"
    assert not (mapped - modules), f"the map names no such module: {sorted(mapped - modules)}"


def test_the_map_reader_sees_both_kinds_of_entry():
    section = "- `io` — x; `engine/kernels/registry`, `tables.inputs` and `docs/analysis.md`\n"
    assert mapped_modules(section) == {
        "kvdiverge.io",
        "kvdiverge.engine.kernels.registry",
        "kvdiverge.tables.inputs",
    }


METADATA_KEYS = {"kvdiverge.clock"}
"""Parquet metadata keys (prefixed ``kvdiverge.``) the architecture cites: not names."""


def defined_names(path: Path) -> set[str]:
    """Top-level names a module defines (definitions, assignments) or exports (``__all__``,
    for a package gathering its modules' names); a name it merely imports is not its own."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                names |= set(ast.literal_eval(node.value))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_every_qualified_name_the_architecture_cites_exists():
    modules = package_modules()
    text = ARCHITECTURE.read_text(encoding="utf-8")
    wrong = []
    for token in sorted(set(re.findall(r"`(kvdiverge(?:\.\w+)+)", text)) - METADATA_KEYS):
        parts = token.split(".")
        cut = max(i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules)
        rest = parts[cut:]
        if rest and rest[0] not in defined_names(modules[".".join(parts[:cut])]):
            wrong.append(token)
    assert not wrong, f"docs/architecture.md cites names that are not there: {wrong}"


def packages() -> list[str]:
    """Every package of ``kvdiverge`` below the top, at any depth (``engine/kernels`` too), as a
    path relative to the package folder."""
    return sorted(
        str(p.parent.relative_to(PACKAGE_DIR)) for p in PACKAGE_DIR.rglob("*/__init__.py")
    )


def _init_all(init: Path) -> list[str] | None:
    """The literal ``__all__`` of a package's ``__init__``, or None where it has none."""
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    return None


@pytest.mark.parametrize("package", packages())
def test_every_package_init_names_its_modules_and_exports_what_it_has(package):
    """At every depth, the ``__init__`` docstring names each module and subpackage (the
    convention's list), and every name of its ``__all__`` (where it has one) is there once and
    importable from it."""
    init = PACKAGE_DIR / package / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    members = sorted(
        p.stem if p.name != "__init__.py" else p.parent.name
        for p in (PACKAGE_DIR / package).iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    )
    missing = [m for m in members if not re.search(rf"\b{m}\b", doc)]
    assert not missing, f"{package}/__init__ docstring does not name {missing}"
    exported = _init_all(init)
    if exported is not None:
        assert len(exported) == len(set(exported)), f"{package}: __all__ repeats a name"
        module = importlib.import_module("kvdiverge." + package.replace("/", "."))
        absent = [n for n in exported if not hasattr(module, n)]
        assert not absent, f"{package}/__init__ lists {absent} in __all__ but has no such name"


def namesakes() -> dict[str, list[str]]:
    """Module basenames used by two packages or more → the modules' dotted names."""
    by_name: dict[str, list[str]] = {}
    for name in package_modules():
        path = package_modules()[name]
        if path.name != "__init__.py":
            by_name.setdefault(name.rsplit(".", 1)[1], []).append(name)
    return {stem: names for stem, names in by_name.items() if len(names) > 1}


@pytest.mark.parametrize("stem", sorted(namesakes()))
def test_namesakes_name_each_other(stem):
    """A module name used in two layers (``accuracy`` in analysis, tables and plots) is kept
    only qualified by its package, and each module's docstring names its namesakes by their
    qualified names (saying how they differ), so a reader of one finds the others."""
    modules = package_modules()
    names = namesakes()[stem]
    for name in names:
        doc = ast.get_docstring(ast.parse(modules[name].read_text(encoding="utf-8"))) or ""
        unnamed = [other for other in names if other != name and other not in doc]
        assert not unnamed, f"{name}'s docstring does not name its namesakes {unnamed}"


ISSUE_NUMBER = re.compile(r"\bissues? #?\d+", flags=re.I)
TIMING = re.compile(r"\b(about|~) ?\d+(\.\d+)? ?(ms|µs|s|seconds|minutes)\b|\d s → \d")
"""A measured time in a comment or docstring ("about 40 ms", "2.9 s → 0.8 s"): benchmark
figures belong in ``benchmarks/README.md``."""


@pytest.mark.parametrize(
    ("pattern", "line", "hit"),
    [
        (ISSUE_NUMBER, "(issue 31, item 4)", True),
        (ISSUE_NUMBER, "the issues 3 documents raise", True),
        (ISSUE_NUMBER, "the issues of a study", False),
        (TIMING, "(about 40 ms for SmolLM2's cache)", True),
        (TIMING, "system time 2.9 s → 0.8 s", True),
        (TIMING, "timeout_s: seconds", False),
    ],
)
def test_the_source_checks_find_what_they_look_for(pattern, line, hit):
    assert bool(pattern.search(line)) is hit


def test_no_issue_numbers_or_benchmark_figures_in_the_source():
    hits = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if ISSUE_NUMBER.search(line) or TIMING.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)
