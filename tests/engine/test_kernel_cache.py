"""The native kernel's build cache heals itself (engine.kernels.build).

A cached library is verified before it is loaded (its size and SHA-256 against the record
written at build time) and after (its symbols and ABI): a truncated library, a library without
the kernel's symbols (with its record left alone, or rewritten to match) and a half-written
record are each removed and rebuilt with one logged line, and the rebuilt one loads. A compiler
that writes garbage and exits 0 leaves nothing in the cache and ``library()`` falls back with
one line. A compiler whose ``--version`` hangs costs one short timeout, and the failure is
cached, so the next process does not run the probe again (until the compiler changes). ``$CC``
with arguments is split like a shell would. These tests need a C compiler for x86-64 (the
library is compiled, not run; the kernel's own results are in test_native_kernel.py)."""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import subprocess
import time

import pytest

from kvdiverge.engine.kernels import build, native


def _compiler_works() -> bool:
    """Whether $CC (default cc) answers --version: the build tests need a real compiler."""
    import os
    import shlex

    try:
        cc = shlex.split(os.environ.get("CC") or "cc")
        return subprocess.run([*cc, "--version"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_compiler = pytest.mark.skipif(
    not _compiler_works() and os.environ.get("KVDIVERGE_REQUIRE_NATIVE") != "1",
    reason="no working C compiler ($CC) here: the kernel cache's build tests need one",
)

COMPILER = build.compiler_command()
pytestmark = pytest.mark.skipif(
    COMPILER is None or platform.machine().lower() not in ("x86_64", "amd64"),
    reason="needs a C compiler for x86-64",
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty kernel cache of this test's own, and a fresh ``library()`` (``native.reset``,
    again afterwards); the kernel not turned off and the CPU read as having AVX-512 (these tests
    build and load the library; none runs the kernel)."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("KVDIVERGE_CACHE", str(folder))
    monkeypatch.delenv("KVDIVERGE_NATIVE", raising=False)
    monkeypatch.setenv("KVDIVERGE_CPU_CAPABILITY", "AVX512")
    native.reset()
    yield folder
    native.reset()  # the tests after it load the library under their own environment


def _script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def _warnings(caplog):
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("kvdiverge.engine.kernels") and r.levelno >= logging.WARNING
    ]


def _libraries(folder):
    return sorted(p.name for p in folder.glob("*.so"))


@needs_compiler
def test_build_once_with_a_record_and_reuse(cache):
    """One build puts the library and its record (size, SHA-256) in the cache; the second call
    finds it verified and does not rebuild."""
    target = build.build(COMPILER)
    record = target.with_suffix(".sha256")
    size, digest = record.read_text().split()
    assert int(size) == target.stat().st_size and len(digest) == 64
    assert build.verify(target) is None
    mtime = target.stat().st_mtime_ns
    assert build.build(COMPILER) == target and target.stat().st_mtime_ns == mtime
    assert _libraries(cache) == [target.name]


def _symbol_less(tmp_path):
    source = tmp_path / "empty.c"
    source.write_text("int unrelated(void) { return 1; }\n")
    out = tmp_path / "empty.so"
    subprocess.run([*COMPILER, "-shared", "-fPIC", "-o", str(out), str(source)], check=True)
    return out


@needs_compiler
@pytest.mark.parametrize(
    "damage", ["truncated", "symbol-less", "symbol-less, record rewritten", "no record"]
)
def test_a_damaged_library_is_rebuilt_with_one_line(damage, cache, tmp_path, caplog):
    """Each damage is found before anything runs from the file; the library is rebuilt once
    with one warning naming the file and what is wrong, and the kernel loads."""
    target = build.build(COMPILER)
    record = target.with_suffix(".sha256")
    if damage == "truncated":
        data = target.read_bytes()
        target.write_bytes(data[: len(data) // 3])
        expected = "truncated or replaced"
    elif damage.startswith("symbol-less"):
        shutil.copyfile(_symbol_less(tmp_path), target)
        expected = "truncated or replaced"
        if damage.endswith("rewritten"):  # the checksum matches: the symbol check catches it
            size, digest = build._checksum(target)
            record.write_text(f"{size} {digest}\n")
            expected = "does not load"
    else:
        record.unlink()
        expected = "has no valid checksum record"
    with caplog.at_level(logging.WARNING):
        lib = native.library()
    assert lib is not None and lib.kvd_abi_version() == build.ABI
    lines = _warnings(caplog)
    assert len(lines) == 1 and expected in lines[0] and "rebuilding" in lines[0], lines
    assert str(target) in lines[0]
    assert build.verify(target) is None
    assert _libraries(cache) == [target.name]


def test_a_compiler_writing_garbage_leaves_nothing_and_falls_back(
    cache, tmp_path, monkeypatch, caplog
):
    """A "compiler" that writes text to its output and exits 0: ``build`` raises one line
    naming it, nothing stays in the cache, and ``library()`` is ``None`` with one warning."""
    garbage = _script(
        tmp_path,
        "garbage-cc",
        'if [ "$1" = --version ]; then echo garbage-cc 1; exit 0; fi\n'
        'while [ "$#" -gt 0 ]; do\n'
        '  if [ "$1" = -o ]; then echo not a library > "$2"; fi; shift\n'
        "done\n"
        "exit 0\n",
    )
    with pytest.raises(build.BuildError, match="wrote a library that it does not load"):
        build.build([garbage])
    assert _libraries(cache) == []
    assert not [p for p in cache.iterdir() if p.name != "compilers.json"]
    monkeypatch.setenv("CC", garbage)
    with caplog.at_level(logging.WARNING):
        assert native.library() is None
    lines = _warnings(caplog)
    assert len(lines) == 1 and "not built" in lines[0] and "garbage-cc" in lines[0], lines
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert native.library() is None
    assert _warnings(caplog) == []  # remembered: not built again (a new try warns again)
    assert _libraries(cache) == []


def test_a_failing_compiler_is_one_line(cache, tmp_path):
    """A compiler that fails its version query or the compilation: one-line BuildError, and no
    temporary file left."""
    for version_ok in (False, True):
        first = 'if [ "$1" = --version ]; then echo fake-cc 1.0; exit 0; fi\n' if version_ok else ""
        broken = _script(
            tmp_path, f"cc-{version_ok}", f"{first}echo 'fake-cc: error' >&2\nexit 1\n"
        )
        with pytest.raises(build.BuildError) as info:
            build.build([broken])
        assert "\n" not in str(info.value) and "fake-cc: error" in str(info.value)
        assert _libraries(cache) == []


def test_a_hanging_version_probe_times_out_once_and_is_cached(cache, tmp_path, monkeypatch, caplog):
    """``--version`` that never answers: the probe gives up after PROBE_SECONDS with one line,
    the failure is recorded, and a second process state does not run the probe again; a changed
    compiler (another mtime) is probed afresh."""
    calls = tmp_path / "calls"
    hanging = _script(tmp_path, "hanging-cc", f'echo "$@" >> {calls}\nexec sleep 30\n')
    monkeypatch.setattr(build, "PROBE_SECONDS", 0.5)
    monkeypatch.setenv("CC", hanging)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert native.library() is None
    assert time.monotonic() - start < 10
    lines = _warnings(caplog)
    assert len(lines) == 1 and "gave no answer in 0.5 s" in lines[0], lines
    assert calls.read_text().splitlines() == ["--version"]
    record = json.loads((cache / "compilers.json").read_text())
    assert [entry for entry in record.values()] == [{"error": "gave no answer in 0.5 s"}]
    native.reset()
    start = time.monotonic()
    assert native.library() is None
    assert time.monotonic() - start < 5  # no probe this time (the calls below say so)
    assert calls.read_text().splitlines() == ["--version"]
    path = tmp_path / "hanging-cc"
    path.write_text(path.read_text() + "\n")  # the compiler changed: probed again
    with pytest.raises(build.BuildError):
        build.compiler_version([hanging])
    assert calls.read_text().splitlines() == ["--version", "--version"]


@needs_compiler
def test_cc_with_arguments_is_split_like_a_shell(cache, monkeypatch):
    """``CC="<compiler> -DKVD_UNUSED='a b'"`` is a command and one argument; the library builds
    with it and loads."""
    monkeypatch.setenv("CC", f"{shutil.which(COMPILER[0]) or COMPILER[0]} -DKVD_UNUSED='a b'")
    command = build.compiler_command()
    assert command[1:] == ["-DKVD_UNUSED=a b"]
    lib = build.load(command)
    assert lib.kvd_abi_version() == build.ABI
    assert len(_libraries(cache)) == 1
