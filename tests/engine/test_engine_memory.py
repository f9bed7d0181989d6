"""The engine's allocator setting (engine.memory): applied once per process on Linux/glibc."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="glibc malloc only",
)
def test_keep_freed_memory_applies_once_on_glibc():
    code = (
        "from kvdiverge.engine import memory\n"
        "first = memory.keep_freed_memory()\n"
        "assert memory._done == [first]\n"
        "assert memory.keep_freed_memory() is first and len(memory._done) == 1\n"
        "print(first)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
