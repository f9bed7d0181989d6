"""Configurations and the one-line check shared by the refusal tests of every layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvdiverge.config import check_config

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
TINY = ROOT / "configs" / "tiny.yaml"


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
