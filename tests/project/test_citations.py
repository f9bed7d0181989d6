"""Citations resolve: every backticked repository path and every cited doc section in `src/`,
`workflow/`, `docs/`, `benchmarks/`, `tests/` (this file's synthetic cases aside), the README
and the changelog exists.

The canonical citation of a section is the cited file's path from the repository root, a comma
and the heading in double quotes: `docs/method.md`, "The coupled pair" (backticks around the
path are optional, so that an error message can carry it as plain text; in reStructuredText
docstrings the path takes double backticks). Several sections of one file follow as
`docs/engine.md`, "Selectors" and "Tests" (joined by commas, "and", "or" or "to"). The old
form `README "<section>"` is refused: the README is `README.md` like any other file.

A backticked path counts as a repository path when its first component is a top-level entry of
the repository (or `kvdiverge/`, read under `src/`); templates (`{study}`, `<name>`), globs and
paths that `.gitignore` ignores (built outputs, materialized models) are not checked. Markdown
links to local files must resolve too. Pure text: no imports of the package, no subprocess.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCANNED = (
    "src",
    "workflow",
    "docs",
    "benchmarks",
    "tests",
    "README.md",
    "CHANGELOG.md",
    "Snakefile",
)
SUFFIXES = {".py", ".smk", ".md", ".rst", ".yaml", ".yml", ".txt"}
# First components of the paths checked: the repository's own top-level entries.
TOP_LEVEL = {
    "src",
    "workflow",
    "docs",
    "tests",
    "benchmarks",
    "configs",
    "profiles",
    "envs",
    "data",
    "Snakefile",
    "config.yaml",
    "README.md",
    "CHANGELOG.md",
    "CITATION.cff",
    "LICENSE",
    "pyproject.toml",
}
TOP_LEVEL_FILES = {name for name in TOP_LEVEL if "." in name or name[0].isupper()}

_MD_PATH = r"(?:[A-Za-z0-9_.-]+/)*[A-Za-z0-9_.-]+\.md"
_SECTION_CITATION = re.compile(
    rf"`{{0,2}}(?P<path>{_MD_PATH})`{{0,2}},\s+\"(?P<first>[^\"\n]+)\""
    r"(?P<more>(?:(?:,\s*|,?\s+(?:and|or|to)\s+)\"[^\"\n]+\")*)"
)
_MORE_SECTION = re.compile(r"\"([^\"\n]+)\"")
_LEGACY_README = re.compile(r"\bREADME(?!\.md)(?:'s)?,?\s+\"(?P<section>[^\"\n]+)\"")
_BACKTICKED = re.compile(r"`{1,2}([^`\s]+?)`{1,2}")
_MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_TEMPLATE = re.compile(r"[{}<>*?$\[\]…|]|\.\.\.")


def _normalise(text: str) -> str:
    """The text with line breaks, comment markers and indentation folded into single spaces, so
    that a citation broken across lines (in a docstring, a comment or a Markdown paragraph)
    reads as one."""
    return re.sub(r"[ \t]*\n[ \t]*(?:#+(?!#)[ \t]*|//[ \t]*)?", " ", text)


def _unquote(heading: str) -> str:
    return re.sub(r"\s+", " ", heading.replace("`", "")).strip()


def headings(markdown: str) -> set[str]:
    """The headings of a Markdown text, outside fenced code blocks, with backticks removed."""
    found, fenced = set(), False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match:
            found.add(_unquote(match.group(2)))
    return found


def _gitignore_patterns(root: Path) -> list[tuple[bool, bool, bool, str]]:
    """(negated, anchored, directory only, pattern) per line of the root `.gitignore`."""
    path = root / ".gitignore"
    patterns = []
    for raw in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        line = line[1:] if negated else line
        directory = line.endswith("/")
        line = line.rstrip("/")
        anchored = "/" in line
        patterns.append((negated, anchored, directory, line.lstrip("/")))
    return patterns


def _glob(pattern: str) -> re.Pattern:
    """A gitignore glob as a regular expression (`*` and `?` stop at `/`, `**` does not)."""
    out = []
    for part in re.split(r"(\*\*|\*|\?)", pattern):
        out.append({"**": ".*", "*": "[^/]*", "?": "[^/]"}.get(part, re.escape(part)))
    return re.compile("".join(out))


def ignored(relative: str, patterns: list[tuple[bool, bool, bool, str]]) -> bool:
    """Whether git ignores `relative` (a path from the root): a parent that is ignored ignores
    everything below it; otherwise the last matching pattern decides."""
    parts = [p for p in relative.split("/") if p]
    for depth in range(1, len(parts) + 1):
        prefix = "/".join(parts[:depth])
        is_dir = depth < len(parts) or relative.endswith("/")
        state = False
        for negated, anchored, directory, pattern in patterns:
            if directory and not is_dir:
                continue
            target = prefix if anchored else parts[depth - 1]
            if _glob(pattern).fullmatch(target):
                state = not negated
        if state:
            return True
    return False


def repository_path(token: str) -> str | None:
    """The repository path a backticked token names, or None when it names none."""
    token = token.rstrip(".,:;)")
    if _TEMPLATE.search(token) or "://" in token or token.startswith(("/", "~", ".")):
        return None
    first = token.split("/", 1)[0]
    if first == "kvdiverge" and "/" in token:
        return "src/" + token
    if first not in TOP_LEVEL:
        return None
    if "/" not in token and first not in TOP_LEVEL_FILES:
        return None
    return token


_FLAT_TEST = re.compile(r"tests/(test_[A-Za-z0-9_]+\.py)(?:::.*)?")


def moved_test(path: str, source: str, root: Path) -> bool:
    """Whether `path`, cited in the changelog, is a test file of the old flat `tests/` that now
    lives in exactly one layer folder (`tests/<layer>/<name>`): the changelog records each
    change with the paths of its day, and the file it names is still found by its unique name.
    Every other source cites the current path."""
    match = _FLAT_TEST.fullmatch(path)
    if source != "CHANGELOG.md" or match is None:
        return False
    return len(list(root.glob(f"tests/*/{match.group(1)}"))) == 1


def check_text(text: str, source: str, root: Path, patterns=None) -> list[str]:
    """Every unresolved citation of `text` (from the file `source`, relative to `root`), one
    line each."""
    patterns = _gitignore_patterns(root) if patterns is None else patterns
    problems = []
    flat = _normalise(text)
    cache: dict[str, set[str] | None] = {}
    missing: set[str] = set()

    def sections_of(path: str) -> set[str] | None:
        if path not in cache:
            file = root / path
            cache[path] = headings(file.read_text(encoding="utf-8")) if file.is_file() else None
        return cache[path]

    for match in _SECTION_CITATION.finditer(flat):
        path = match.group("path")
        if "." in path.rsplit("/", 1)[-1][: -len(".md")]:
            continue  # code, not a file: an attribute such as `snakemake.output.md, "..."`
        cited = [match.group("first")] + _MORE_SECTION.findall(match.group("more"))
        known = sections_of(path)
        if known is None:
            missing.add(path)
            problems.append(f"{source}: cites {path}, which does not exist")
            continue
        for section in cited:
            if "<" in section:
                continue  # a placeholder such as "<heading>"
            if _unquote(section) not in known:
                problems.append(f'{source}: {path} has no section "{section}"')
    for match in _LEGACY_README.finditer(flat):
        problems.append(
            f'{source}: README "{match.group("section")}": cite a file and its heading, '
            f'`docs/<page>.md`, "<heading>" (README.md for the README)'
        )
    for match in _BACKTICKED.finditer(text):
        path = repository_path(match.group(1))
        if path is None or path in missing or ignored(path, patterns):
            continue
        if not (root / path).exists() and not moved_test(path, source, root):
            problems.append(f"{source}: `{match.group(1)}` does not exist")
    if source.endswith(".md"):
        base = (root / source).parent
        for match in _MD_LINK.finditer(text):
            target = match.group(1).split("#", 1)[0]
            if not target or "://" in target or target.startswith("mailto:"):
                continue
            if not (base / target).exists():
                problems.append(f"{source}: link target {target} does not exist")
    return problems


def _scanned_files(root: Path) -> list[Path]:
    files = []
    for name in SCANNED:
        path = root / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(
                p
                for p in sorted(path.rglob("*"))
                if p.is_file()
                and p.suffix in SUFFIXES
                and not any(part.endswith(".egg-info") or part == "__pycache__" for part in p.parts)
            )
    return files


def test_citations_resolve():
    patterns = _gitignore_patterns(ROOT)
    problems = []
    for path in _scanned_files(ROOT):
        if path == Path(__file__).resolve():
            continue  # its synthetic cases do not resolve on purpose
        source = path.relative_to(ROOT).as_posix()
        problems += check_text(path.read_text(encoding="utf-8"), source, ROOT, patterns)
    assert not problems, "unresolved citations:\n" + "\n".join(problems)


def test_the_checker_finds_what_does_not_resolve(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n\n## Real section\n\n```\n## Not a heading\n```\n\n### `Coded` heading\n",
        encoding="utf-8",
    )
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "there.py").write_text("", encoding="utf-8")
    (tmp_path / ".gitignore").write_text("/results/\n/data/*\n!/data/kept/\n", encoding="utf-8")
    (tmp_path / "data" / "kept").mkdir(parents=True)
    good = (
        'See `docs/page.md`, "Real section" and "Coded heading"; ``src/there.py``;\n'
        '# docs/page.md, "Real\n# section"; `data/generated/model`; `results/x.csv`;\n'
        "`src/{name}.py`; `workflow/rules/*.smk`; [page](docs/page.md#real-section)\n"
    )
    assert check_text(good, "README.md", tmp_path) == []
    assert check_text('write(snakemake.output.md, "text")\n', "src/x.py", tmp_path) == []
    # a test file moved into its layer folder: found by its name from the changelog only
    (tmp_path / "tests" / "engine").mkdir(parents=True)
    (tmp_path / "tests" / "engine" / "test_moved.py").write_text("", encoding="utf-8")
    moved = "`tests/test_moved.py`; `tests/test_never.py`\n"
    assert [p.split(": ", 1)[1] for p in check_text(moved, "CHANGELOG.md", tmp_path)] == [
        "`tests/test_never.py` does not exist"
    ]
    assert len(check_text(moved, "docs/page.md", tmp_path)) == 2
    bad = (
        '`docs/page.md`, "Missing section"; `docs/gone.md`, "Real section";\n'
        '(README "Datasets"); `src/missing.py`; ``kvdiverge/absent.py``;\n'
        '`docs/page.md`, "Real section" and "Not a heading"; `data/kept/absent.txt`;\n'
        "[gone](docs/gone.md)\n"
    )
    problems = check_text(bad, "README.md", tmp_path)
    expected = [
        'docs/page.md has no section "Missing section"',
        "cites docs/gone.md, which does not exist",
        'README "Datasets"',
        "`src/missing.py` does not exist",
        "`kvdiverge/absent.py` does not exist",
        'docs/page.md has no section "Not a heading"',
        "`data/kept/absent.txt` does not exist",
        "link target docs/gone.md does not exist",
    ]
    for fragment in expected:
        assert any(fragment in p for p in problems), (fragment, problems)
    assert len(problems) == len(expected), problems
