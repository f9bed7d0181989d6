"""A config's models (``models.<name>``; ``docs/configuration.md``, "Models"): where each one's
folder is, and the names that point at a model.

A model has exactly one of three forms: ``demo`` (a tiny demo model built into
``data/models/<name>``), ``source`` (a GGUF file materialized into ``data/models/<name>``), or
``path`` (a local folder or hub id); a built or materialized model may restate its path, but
only as ``data/models/<name>``, and only a demo model takes ``train``. :func:`model_path` is the
one reading of that rule: the parse-time check (:func:`check_models`) and the workflow's rules
(``workflow/rules/common.smk``) both call it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvdiverge.config.errors import ConfigError

__all__ = ["BUILT_MODELS", "check_length_tokenizer", "check_models", "model_path"]

BUILT_MODELS = "data/models"
"""The folder every demo and sourced model is written into, one subfolder per model name."""


def _names(items: Iterable[str]) -> str:
    return ", ".join(items) or "none configured"


def model_path(config: Mapping[str, Any], name: str) -> str:
    """The folder (or hub id) model ``name`` loads from: ``data/models/<name>`` for a demo or
    sourced model, else its configured ``path``. One
    :class:`~kvdiverge.config.errors.ConfigError` line naming ``config.models.<name>`` when
    the model is not configured, has both ``demo`` and ``source``, restates another path for a
    built model, or has none of ``path``, ``demo`` and ``source``."""
    models = config.get("models", {})
    spec = models.get(name)
    where = f"config.models.{name}"
    if spec is None:
        raise ConfigError(f"config.models: no model named {name!r} ({_names(models)})")
    if spec.get("demo") and spec.get("source"):
        raise ConfigError(f"{where}: expected `demo` or `source`, not both")
    if spec.get("demo") or spec.get("source"):
        path = f"{BUILT_MODELS}/{name}"
        if spec.get("path", path) != path:
            kind = "a demo model is built" if spec.get("demo") else "a sourced model is written"
            raise ConfigError(f"{where}.path: {kind} into {path}, got {spec['path']!r}")
        return path
    if not spec.get("path"):
        raise ConfigError(f"{where}: expected `path` (directory or hub id), `demo` or `source`")
    return spec["path"]


def check_models(config: Mapping[str, Any]) -> None:
    """Every model's form (:func:`model_path`), and ``train`` on a demo model only; one
    :class:`~kvdiverge.config.errors.ConfigError` line naming the model's field."""
    for name, spec in config.get("models", {}).items():
        model_path(config, name)
        if spec.get("train") is not None and not spec.get("demo"):
            raise ConfigError(
                f"config.models.{name}.train: only a `demo` model is trained; remove `train`"
            )


def check_length_tokenizer(config: Mapping[str, Any]) -> None:
    """``datasets.length_tokenizer`` names a configured model (whose tokenizer measures the
    strata's lengths), where any study builds documents."""
    if not config.get("studies"):
        return  # no documents are built
    name = config.get("datasets", {}).get("length_tokenizer")
    models = config.get("models", {})
    if name not in models:
        raise ConfigError(
            f"config.datasets.length_tokenizer: expected the name of a configured model "
            f"({_names(models)}), got {name!r}"
        )
