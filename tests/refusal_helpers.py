"""The one-line check and the configurations shared by the refusal tests of every layer."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from kvdiverge.config import check_config
from kvdiverge.config.names import NAME_PATTERN

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
TINY = ROOT / "configs" / "tiny.yaml"
NAME_RULE = (
    f"expected a name matching {NAME_PATTERN} without '..' (a letter or digit, then letters, "
    "digits and _ . + = @ -)"
)
"""What a refused name's line says it expected (kvdiverge.config.names)."""


def tiny() -> dict:
    """``configs/tiny.yaml`` as a fresh dictionary."""
    return yaml.safe_load(TINY.read_text())


def one_line(info: pytest.ExceptionInfo) -> str:
    """The raised error's message, asserted to be one line."""
    message = str(info.value)
    assert "\n" not in message, message
    return message


def tiny_with_extra_model(folder) -> dict:
    """The tiny config with a third model ``extra`` at ``folder`` (a path or a hub id), its
    family of endpoints and bootstrap draws sized for three models, checked against the
    schema (defaults filled)."""
    cfg = tiny()
    cfg["models"]["extra"] = {"path": str(folder)}
    cfg["studies"]["study2"]["family_endpoints"] = 12  # a third model: 2 x 2 x 3 endpoints
    cfg["studies"]["study2"]["bootstrap_draws"] = 24000  # >= 50 per tail at 1 - 0.05/12
    check_config(cfg, SCHEMA)
    return cfg


def run_python(code: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``code`` (dedented) run by this interpreter in a fresh process with ``args``: for cases
    that kill the process or need a clean interpreter."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )
