"""Rerun fingerprints derived from the code: the package modules a workflow script reaches.

Snakemake reruns a job when its params change, but it does not track the Python modules a
script imports. Each rule therefore passes ``code=script_fingerprint(<its script>)``: a digest
of the code (docstrings, comments and blank lines left out: :func:`code_text`) of every
``kvdiverge`` module the script reaches by import, found by reading the import statements
(anywhere in a file, function-level imports included) transitively, without importing
anything. Editing a module's code reruns exactly the rules whose scripts reach it; nobody keeps
a list by hand. A rollout job's fingerprint covers only the selectors its actions use
(``selectors=``), so adding a method reruns no other job (``docs/architecture.md``, "Reruns").
A native source beside a reached module (a kernel's C file, :func:`native_sources`) is hashed
too: the module that compiles and loads it sits in its folder.
"""

from __future__ import annotations

import ast
import atexit
import functools
import hashlib
import importlib.machinery
import io
import json
import os
import tokenize
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path

__all__ = [
    "PACKAGE",
    "REGISTER_DECORATOR",
    "code_text",
    "direct_imports",
    "imported_modules",
    "module_file",
    "module_fingerprint",
    "native_sources",
    "script_fingerprint",
    "selector_code",
]

PACKAGE = "kvdiverge"

# ---- a cache of source analyses across processes ------------------------------------------------
# Every Snakemake invocation fingerprints the same few dozen modules: parsing and tokenizing them
# took seconds of each dry run. Results are kept in a JSON file under the user's cache folder
# (KVDIVERGE_CACHE, else $XDG_CACHE_HOME/kvdiverge or ~/.cache/kvdiverge), keyed by the SHA-256
# of the function's name and arguments (the source text itself), so an entry can never be stale;
# a missing, unreadable or unwritable file only costs the time.
_DISK_CACHE_FORMAT = 1
_DISK_CACHE_ENTRIES = 4000


def _disk_cache_file() -> Path:
    root = os.environ.get("KVDIVERGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "kvdiverge",
    )
    return Path(root) / f"source-analysis-v{_DISK_CACHE_FORMAT}.json"


class _DiskCache:
    """Results of pure functions of source text, read once per process and written at exit."""

    def __init__(self) -> None:
        self.entries: dict[str, object] | None = None
        self.dirty = False

    def _load(self) -> dict[str, object]:
        if self.entries is None:
            try:
                loaded = json.loads(_disk_cache_file().read_text(encoding="utf-8"))
                self.entries = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError):
                self.entries = {}
            atexit.register(self.save)
        return self.entries

    def get(self, key: str) -> object | None:
        return self._load().get(key)

    def put(self, key: str, value: object) -> None:
        entries = self._load()
        entries.pop(key, None)
        entries[key] = value  # newest last: the oldest go first when the file is full
        self.dirty = True

    def save(self) -> None:
        """Write the entries (the newest :data:`_DISK_CACHE_ENTRIES`) atomically, if any are new."""
        if not self.dirty or self.entries is None:
            return
        from kvdiverge.io import atomic_write_text

        kept = dict(list(self.entries.items())[-_DISK_CACHE_ENTRIES:])
        try:
            atomic_write_text(_disk_cache_file(), json.dumps(kept))
            self.dirty = False
        except OSError:
            pass


_DISK_CACHE = _DiskCache()


def _disk_cached(encode: Callable, decode: Callable) -> Callable:
    """Memoize a pure function of strings in memory and in :data:`_DISK_CACHE`; ``encode``
    and ``decode`` turn its result into JSON and back."""

    def wrap(func: Callable) -> Callable:
        @functools.wraps(func)
        @cache
        def cached(*args: object) -> object:
            key = hashlib.sha256(
                json.dumps([func.__name__, *args], ensure_ascii=False).encode()
            ).hexdigest()
            found = _DISK_CACHE.get(key)
            if found is not None:
                return decode(found)
            result = func(*args)
            _DISK_CACHE.put(key, encode(result))
            return result

        return cached

    return wrap


@cache
def module_file(name: str) -> Path | None:
    """The source file of module or package ``name`` (a package's ``__init__.py``), or ``None``
    when there is no such module.

    Nothing is imported: each dotted prefix is looked up with
    :meth:`importlib.machinery.PathFinder.find_spec` in its parent's search locations, so the
    answer depends on the files on ``sys.path`` alone, never on what ``sys.modules`` happens to
    hold (``importlib.util.find_spec`` imports a submodule's parents, and then answers from
    whatever package of that name was imported first).
    """
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        return None
    search: list[str] | None = None
    spec = None
    for depth in range(1, len(parts) + 1):
        if depth > 1 and not search:
            return None  # a module, not a package, cannot hold submodules
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
    if spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


def _parents(name: str) -> list[str]:
    """``a.b.c`` → ``[a, a.b]``: the packages whose ``__init__`` runs before ``a.b.c``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def direct_imports(path: Path, own: str | None) -> set[str]:
    """Package modules named by the import statements of the file ``path`` (module ``own``):
    the edges of the import graph that the rerun fingerprints and the layout check walk."""
    found = _imported_names(path.read_text(), own, path.name == "__init__.py")
    return {
        name
        for name in found
        if (name == PACKAGE or name.startswith(PACKAGE + ".")) and module_file(name) is not None
    }


@_disk_cached(encode=sorted, decode=frozenset)
def _imported_names(source: str, own: str | None, is_package: bool) -> frozenset[str]:
    """Every module name the import statements of ``source`` (module ``own``, a package's
    ``__init__`` when ``is_package``) name, relative imports resolved. Cached by the source
    text: one workflow parse fingerprints the same modules for many rules."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module's package
                if own is None:
                    continue
                base = own.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return frozenset(found)


def imported_modules(entries: Iterable[str | os.PathLike]) -> list[str]:
    """Every package module reached by import from ``entries``, sorted.

    An entry is a script path (a ``.py`` file outside the package) or a module name. The
    result holds the modules the entries import, what those import in turn, and the packages
    above each of them (their ``__init__`` runs too).
    """
    pending: list[tuple[Path, str | None]] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        for module in [*_parents(name), name]:
            if module not in seen and (source := module_file(module)) is not None:
                seen.add(module)
                pending.append((source, module))

    for entry in entries:
        text = str(entry)
        if text.endswith(".py") or os.sep in text:
            path = Path(text)
            if not path.is_file():
                raise FileNotFoundError(f"script_fingerprint: no script {text!r}")
            pending.append((path, None))
        elif module_file(text) is None:
            raise ModuleNotFoundError(f"script_fingerprint: no module named {text!r}")
        else:
            visit(text)
    while pending:
        path, own = pending.pop()
        for name in direct_imports(path, own):
            visit(name)
    return sorted(seen)


REGISTER_DECORATOR = "register_selector"
"""The decorator that registers a selector class (:func:`kvdiverge.eviction.register_selector`);
:func:`script_fingerprint` with ``selectors`` leaves the classes it decorates out."""


def _registered_class_lines(tree: ast.Module) -> dict[str, range]:
    """Top-level classes decorated with :data:`REGISTER_DECORATOR`: name -> their 0-based lines,
    decorators included."""
    found = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        names = [
            d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else ""
            for d in node.decorator_list
        ]
        if REGISTER_DECORATOR in names:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            found[node.name] = range(first - 1, node.end_lineno)
    return found


@cache
def _without_registered_classes(source: str) -> str:
    """``source`` less its registered selector classes (:func:`_registered_class_lines`)."""
    lines = source.splitlines()
    drop = set()
    for span in _registered_class_lines(ast.parse(source)).values():
        drop.update(span)
    return "\n".join(line for i, line in enumerate(lines) if i not in drop) + "\n"


def selector_code(selector: str) -> str:
    """The code (:func:`code_text`) of one selector, named ``"module:Class"``: the class alone
    when its module belongs to the package, else its whole module (a method of one's own may
    lean on helpers beside it). One-line error when there is no such module or class."""
    module, _, name = selector.partition(":")
    path = module_file(module)
    if path is None:
        raise ModuleNotFoundError(f"script_fingerprint: no module named {module!r}")
    source = path.read_text(encoding="utf-8")
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        return code_text(source)
    lines = source.splitlines()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            return code_text("\n".join(lines[first - 1 : node.end_lineno]) + "\n")
    raise LookupError(f"script_fingerprint: module {module!r} has no class {name!r}")


def script_fingerprint(*entries: str | os.PathLike, selectors: Iterable[str] | None = None) -> str:
    """SHA-256 (first 16 hex digits) of the names and code (:func:`code_text`) of
    :func:`imported_modules` ``(entries)``: a ``params:`` entry that changes exactly when the
    code of a module the rule's script reaches changes (docstrings and comments aside). The
    scripts themselves are not hashed (Snakemake already reruns a job whose script changed).

    ``selectors`` (``"module:Class"`` names; a rollout job's) narrows the methods: the package's
    registered selector classes (decorated with :data:`REGISTER_DECORATOR`) are left out of
    their modules, and only the named selectors' code is added (:func:`selector_code`). So
    editing or adding one selector changes only the fingerprints of the jobs that use it.
    """
    digest = hashlib.sha256()
    modules = imported_modules(entries)
    for name in modules:
        source = module_file(name).read_text(encoding="utf-8")
        if selectors is not None:
            source = _without_registered_classes(source)
        digest.update(name.encode() + b"\0")
        digest.update(code_text(source).encode())
    for path in native_sources(modules):
        digest.update(f"{path.parent.name}/{path.name}".encode() + b"\0")
        digest.update(path.read_bytes())
    for selector in sorted(set(selectors or ())):
        digest.update(selector.encode() + b"\0")
        digest.update(selector_code(selector).encode())
    return digest.hexdigest()[:16]


NATIVE_SUFFIXES = (".c", ".h", ".cc", ".cpp", ".cu", ".cuh")
"""Native source files that a module beside them may compile and load (a kernel)."""


def native_sources(modules: Iterable[str]) -> list[Path]:
    """The native sources (:data:`NATIVE_SUFFIXES`) in the folder of each module of
    ``modules`` (a package's ``__init__`` excepted: a kernel is loaded by a module beside its
    source), sorted: what :func:`script_fingerprint` hashes, byte for byte, beside the Python
    code, so an edit of a kernel's C source reruns every rule whose script reaches the module
    that builds it, and no other."""
    folders = {
        module_file(name).parent
        for name in modules
        if module_file(name) is not None and module_file(name).name != "__init__.py"
    }
    return sorted(
        path
        for folder in folders
        for path in folder.iterdir()
        if path.suffix in NATIVE_SUFFIXES and path.is_file()
    )


@_disk_cached(encode=str, decode=str)
def code_text(source: str) -> str:
    """``source`` without its docstrings, comments and blank lines, and with trailing spaces
    removed: the part of a module that can change what it computes.

    Docstrings are located by the syntax tree (the first statement of a module, class or
    function when it is a string literal) and comments by the tokenizer, both of which give
    the same positions on every supported Python version, so the text depends on the source
    alone.
    """
    lines = source.splitlines()
    drop: set[int] = set()  # 0-based lines wholly taken by a docstring
    cut: dict[int, int] = {}  # 0-based line -> column where a comment starts
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                doc = body[0]
                # the syntax tree's columns count UTF-8 bytes
                before = lines[doc.lineno - 1].encode()[: doc.col_offset]
                after = lines[doc.end_lineno - 1].encode()[doc.end_col_offset :]
                alone = before.strip() == b"" and after.strip() in (b"", b";")
                if alone:  # else the docstring shares a line with code: keep it all
                    drop.update(range(doc.lineno - 1, doc.end_lineno))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            cut[row - 1] = col
    kept = []
    for number, line in enumerate(lines):
        if number in drop:
            continue
        line = line[: cut.get(number, len(line))].rstrip()
        if line:
            kept.append(line)
    return "\n".join(kept) + "\n"


def module_fingerprint(*modules: str) -> str:
    """SHA-256 (first 16 hex digits) of the code (:func:`code_text`) of the named modules,
    found without importing them; a package name covers every ``.py`` file below it.

    Editing a docstring or a comment leaves it unchanged; editing code changes it. The demo
    models' training fingerprint is built on it (:mod:`kvdiverge.models.training`).
    """
    digest = hashlib.sha256()
    for name in sorted(modules):
        origin = module_file(name)
        if origin is None:
            raise ModuleNotFoundError(f"module_fingerprint: no module named {name!r}")
        files = sorted(origin.parent.rglob("*.py")) if origin.name == "__init__.py" else [origin]
        for f in files:
            digest.update(f.name.encode())
            digest.update(code_text(f.read_text(encoding="utf-8")).encode())
    return digest.hexdigest()[:16]
