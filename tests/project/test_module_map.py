"""The docs and the package agree: `docs/architecture.md`'s module map ("## Modules") names every
module of the package and no module that is not there; every qualified name the architecture
cites (``kvdiverge.x.y.name``) exists where it says; every subpackage's ``__init__`` docstring
names its modules; no code comment or docstring under ``src/`` carries an issue
number."""

from __future__ import annotations

import ast
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


@pytest.mark.parametrize("package", subpackages())
def test_each_subpackage_init_covers_its_modules(package):
    """The ``__init__`` docstring names every module (and subpackage) of the subpackage."""
    init = PACKAGE_DIR / package / "__init__.py"
    tree = ast.parse(init.read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree) or ""
    members = sorted(
        p.stem if p.name != "__init__.py" else p.parent.name
        for p in (PACKAGE_DIR / package).iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    )
    missing = [m for m in members if not re.search(rf"\b{m}\b", doc)]
    assert not missing, f"{package}/__init__ docstring does not name {missing}"


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
