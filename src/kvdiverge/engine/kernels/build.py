"""The native kernel's build cache: compiled once per source, compiler and flags, verified
before every load, healed when damaged.

The shared library (:data:`SOURCES`: the prompt kernel and the rows' own kernel, with their
shared header) is built into ``$KVDIVERGE_CACHE`` (default ``$XDG_CACHE_HOME/kvdiverge`` or
``~/.cache/kvdiverge``) as ``attention-<digest>.so``, the digest covering the C sources and
header, the flags, the ABI and the compiler's ``--version``. At build time the compiler's output is
loaded in a separate process (a file that is not a loadable library with the kernel's symbols
and ABI crashes that process, not this one) and a checksum file beside it records its size and
SHA-256; both are put in place by atomic renames, so concurrent jobs can share the cache.
Before a cached library is loaded, its size and SHA-256 are checked against that record (a
truncated, replaced or half-written file is never mapped: a truncated ELF file can crash the
loading process), and after loading its symbols and ABI. A library failing either check is
removed and rebuilt once, with one logged line; if that fails too the engine keeps the library
kernels. The compiler's ``--version`` probe has a short timeout (:data:`PROBE_SECONDS`), and its
result (the version, or the failure) is cached per compiler executable (path, size, mtime) in
``compilers.json``, so a hanging compiler stalls one process once, not every process.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = [
    "ABI",
    "FLAGS",
    "SOURCE",
    "SOURCES",
    "BuildError",
    "build",
    "cache_dir",
    "compiler_command",
    "compiler_version",
    "load",
    "verify",
]

log = logging.getLogger(__name__)

ABI = 2  # kvd_abi_version() of the C sources
SYMBOLS = ("kvd_prompt_attention", "kvd_own_attention", "kvd_abi_version")
SOURCE = Path(__file__).with_name("prompt_attention.c")
SOURCES = (SOURCE, SOURCE.with_name("own_attention.c"))
"""The C files compiled into the one library (the prompt kernel first)."""
HEADERS = (SOURCE.with_name("attention_math.h"),)
FLAGS = ("-O3", "-mavx512f", "-mfma", "-fPIC", "-shared")
PROBE_SECONDS = 10.0  # the compiler's --version
COMPILE_SECONDS = 300.0
LOAD_SECONDS = 60.0  # the build-time load in a separate process


class BuildError(RuntimeError):
    """The kernel could not be built or loaded; the message is one line for the log."""


def cache_dir() -> Path:
    """``$KVDIVERGE_CACHE``, else ``$XDG_CACHE_HOME/kvdiverge``, else ``~/.cache/kvdiverge``."""
    root = os.environ.get("KVDIVERGE_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvdiverge"


def compiler_command() -> list[str] | None:
    """``$CC`` split like a shell would (``CC="ccache gcc -march=native"`` is a command and its
    arguments), else ``cc`` or ``gcc`` on the PATH; ``None`` when there is none."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        return shlex.split(cc)
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _executable_id(command: list[str]) -> str:
    exe = shutil.which(command[0]) or command[0]
    try:
        st = os.stat(exe)
    except OSError:
        return f"{exe}:missing"
    return f"{os.path.realpath(exe)}:{st.st_size}:{st.st_mtime_ns}"


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def compiler_version(command: list[str]) -> str:
    """The compiler's ``--version`` output; raises :class:`BuildError` when it fails, exits
    non-zero or takes over :data:`PROBE_SECONDS`. The result (version or failure) is cached
    in ``compilers.json`` per executable and arguments, and reused while the executable's
    path, size and mtime are the same."""
    record = cache_dir() / "compilers.json"
    key = f"{shlex.join(command)} @ {_executable_id(command)}"
    try:
        known = json.loads(record.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    entry = known.get(key)
    if not isinstance(entry, dict):
        try:
            done = subprocess.run(
                [*command, "--version"],
                capture_output=True,
                text=True,
                timeout=PROBE_SECONDS,
                stdin=subprocess.DEVNULL,
            )
            if done.returncode == 0:
                entry = {"version": done.stdout}
            else:
                entry = {"error": f"exited {done.returncode} ({done.stderr.strip()[:200]})"}
        except subprocess.TimeoutExpired:
            entry = {"error": f"gave no answer in {PROBE_SECONDS:g} s"}
        except OSError as exc:
            entry = {"error": str(exc)}
        known[key] = entry
        try:
            _write_json(record, known)
        except OSError:
            pass  # a read-only cache: probed again next time
    if "error" in entry:
        raise BuildError(f"compiler {shlex.join(command)!r} --version {entry['error']}")
    return str(entry["version"])


def _checksum(path: Path) -> tuple[int, str]:
    data = path.read_bytes()
    return len(data), hashlib.sha256(data).hexdigest()


def _record_of(target: Path) -> Path:
    return target.with_suffix(".sha256")


def verify(target: Path) -> str | None:
    """Why the cached library ``target`` must not be loaded, or ``None`` when its size and
    SHA-256 are those recorded beside it at build time."""
    record = _record_of(target)
    if not target.exists():
        return "is missing"
    try:
        size, digest = record.read_text().split()
        size = int(size)
    except (OSError, ValueError):
        return "has no valid checksum record"
    actual = target.stat().st_size
    if actual != size:
        return f"is {actual} bytes, {size} when built (truncated or replaced)"
    if _checksum(target)[1] != digest:
        return "differs from its build-time checksum"
    return None


_PROBE = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
for name in sys.argv[3:]:
    getattr(lib, name)
sys.exit(0 if lib.kvd_abi_version() == int(sys.argv[2]) else 3)
"""


def _probe_load(path: Path) -> str | None:
    """Load ``path`` in a separate Python process and check its symbols and ABI: ``None`` if
    it loads, else why not (a crash there cannot take this process down)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, str(path), str(ABI), *SYMBOLS],
            capture_output=True,
            text=True,
            timeout=LOAD_SECONDS,
        )
    except subprocess.TimeoutExpired:
        return f"loading it took over {LOAD_SECONDS:g} s"
    if done.returncode == 0:
        return None
    if done.returncode == 3:
        return f"its ABI is not {ABI}"
    last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return f"it does not load ({last[:200]})"


def _digest(version: str) -> str:
    parts = [path.read_bytes() for path in (*SOURCES, *HEADERS)]
    parts += [" ".join(FLAGS).encode(), str(ABI).encode(), version.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def build(command: list[str]) -> Path:
    """The verified library for this source, compiler and flags: the cached one when it
    passes :func:`verify`, else built now (the compiler's output loaded in a separate process,
    its checksum recorded, both renamed into place). Raises :class:`BuildError` with one line."""
    version = compiler_version(command)
    target = cache_dir() / f"attention-{_digest(version)}.so"
    problem = verify(target)
    if problem is None:
        return target
    if target.exists() or _record_of(target).exists():
        log.warning("native prompt kernel: cached %s %s; rebuilding it", target, problem)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    except OSError as exc:
        raise BuildError(f"cache {target.parent} not writable ({exc})") from exc
    os.close(fd)
    tmp_record = tmp + ".sha256"
    try:
        try:
            done = subprocess.run(
                [*command, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"],
                capture_output=True,
                text=True,
                timeout=COMPILE_SECONDS,
                stdin=subprocess.DEVNULL,
            )
        except (subprocess.TimeoutExpired, OSError) as exc:
            raise BuildError(f"compiler {shlex.join(command)!r} failed ({exc})") from exc
        if done.returncode != 0:
            detail = (done.stderr.strip().splitlines() or [""])[-1][:200]
            raise BuildError(
                f"compiler {shlex.join(command)!r} exited {done.returncode} ({detail})"
            )
        bad = _probe_load(Path(tmp))
        if bad is not None:
            raise BuildError(f"compiler {shlex.join(command)!r} wrote a library that {bad}")
        size, digest = _checksum(Path(tmp))
        Path(tmp_record).write_text(f"{size} {digest}\n")
        os.replace(tmp_record, _record_of(target))
        os.replace(tmp, target)
    finally:
        for leftover in (tmp, tmp_record):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target


def load(command: list[str]) -> ctypes.CDLL:
    """Build (or find) the library, load it and check its symbols and ABI; a loaded library
    lacking them is removed and rebuilt once. Raises :class:`BuildError` with one line."""
    for attempt in (0, 1):
        path = build(command)
        problem = verify(path)  # again: another process may have replaced it meanwhile
        if problem is None:
            # after a failed load, a copy under a fresh name: the loader would hand back the
            # library already loaded from this path
            where = path
            if attempt:
                where = path.with_name(f"{path.stem}.{os.getpid()}.so")
                shutil.copyfile(path, where)
            try:
                lib = ctypes.CDLL(str(where))
                for name in SYMBOLS:
                    getattr(lib, name)
                lib.kvd_abi_version.restype = ctypes.c_int
                if lib.kvd_abi_version() == ABI:
                    return lib
                problem = f"has ABI {lib.kvd_abi_version()}, not {ABI}"
            except (OSError, AttributeError) as exc:
                problem = f"does not load ({str(exc)[:200]})"
            finally:
                if where != path:
                    where.unlink(missing_ok=True)
        if attempt == 0:
            log.warning("native prompt kernel: cached %s %s; rebuilding it", path, problem)
            for stale in (path, _record_of(path)):
                stale.unlink(missing_ok=True)
    raise BuildError(f"library {path} {problem} after a rebuild")
