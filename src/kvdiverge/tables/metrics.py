"""``metrics.json``: one machine-readable results file per compare folder and per study.

A record holds what a reader needs to put several runs side by side without opening their
folders: ``kind`` (``compare`` or ``study``), ``name`` (the folder or the study), ``models``,
``actions`` (each action's parameters by name), ``baseline``, ``settings`` (the values that
decide whether two runs' numbers are comparable: :data:`COMPARED_SETTINGS`, and the others
the run had), ``digest`` (SHA-256 of the canonical JSON of models, actions and settings: two
runs with the same digest ran the same design), ``lock`` (a study's lock hash; null for a
comparison), ``config_sha256`` (a study's effective config), and the numbers: ``estimands``
(every row of ``estimands.csv``: model, action, contrast, stratum, estimand, value,
interval, level, documents, paths), ``contrasts`` (each action minus the baseline, with its
interval: ``contrasts.csv``'s rows; empty without a baseline) and ``accuracy``
(``accuracy.csv``'s pooled rows). Non-finite numbers are written as null, so the file is
strict JSON. :func:`read_metrics` checks a file back, one line naming it on any fault.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

__all__ = [
    "COMPARED_SETTINGS",
    "METRICS_FILE",
    "METRICS_VERSION",
    "MetricsError",
    "design_digest",
    "metrics_record",
    "read_metrics",
    "write_metrics",
]

METRICS_FILE = "metrics.json"
METRICS_VERSION = 1
COMPARED_SETTINGS = (
    "H",
    "temperature",
    "K",
    "coupling",
    "level",
    "draws",
    "metric",
    "documents",
)
"""Settings whose difference makes two runs' numbers incomparable (a horizon, a decoding
temperature, replicates, the coupling, the interval level, bootstrap draws, the accuracy
metric, the documents): ``kvdiverge merge`` refuses runs that differ in one unless told it may
(``--allow``). Models, actions and seeds may differ: they are what a merge compares."""
_KEYS = ("version", "kind", "name", "models", "actions", "baseline", "settings", "digest")
_KEYS += ("estimands", "contrasts", "accuracy")


class MetricsError(ValueError):
    """A ``metrics.json`` that cannot be read or is not one (one line naming the file)."""


def _clean(value: Any) -> Any:
    """JSON data with every non-finite float as None (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def design_digest(models: Sequence[str], actions: Mapping[str, Any], settings: Mapping) -> str:
    """SHA-256 of the canonical JSON (sorted keys, no spaces) of the models, the actions'
    parameters and the settings."""
    text = json.dumps(
        _clean({"models": list(models), "actions": actions, "settings": settings}),
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def _rows(frame: pl.DataFrame | None) -> list[dict[str, Any]]:
    return [] if frame is None else _clean(frame.to_dicts())


def metrics_record(
    *,
    kind: str,
    name: str,
    models: Sequence[str],
    actions: Mapping[str, Mapping[str, Any]],
    baseline: str | Mapping[str, str] | None,
    settings: Mapping[str, Any],
    estimands: pl.DataFrame,
    contrasts: pl.DataFrame | None = None,
    accuracy: pl.DataFrame | None = None,
    lock: str | None = None,
    config_sha256: str | None = None,
    package_version: str | None = None,
) -> dict[str, Any]:
    """The ``metrics.json`` record of one run (module docstring); every key of
    :data:`COMPARED_SETTINGS` must be in ``settings`` (None where the run has no value)."""
    missing = [k for k in COMPARED_SETTINGS if k not in settings]
    if missing:
        raise ValueError(f"metrics: settings lack {', '.join(missing)}")
    pooled_accuracy = None
    if accuracy is not None and "stratum" in accuracy.columns:
        pooled_accuracy = accuracy.filter(pl.col("stratum") == "pooled")
    return {
        "version": METRICS_VERSION,
        "kind": kind,
        "name": name,
        "models": list(models),
        "actions": _clean(dict(actions)),
        "baseline": dict(baseline) if isinstance(baseline, Mapping) else baseline,
        "settings": _clean(dict(settings)),
        "digest": design_digest(models, actions, settings),
        "lock": lock,
        "config_sha256": config_sha256,
        "package_version": package_version,
        "estimands": _rows(estimands),
        "contrasts": _rows(contrasts),
        "accuracy": _rows(pooled_accuracy if pooled_accuracy is not None else accuracy),
    }


def write_metrics(record: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write ``record`` as strict JSON (indented), atomically."""
    from kvdiverge.io import atomic_write_text

    text = json.dumps(_clean(dict(record)), indent=1, allow_nan=False, default=str)
    atomic_write_text(path, text + "\n")


def read_metrics(path: str | os.PathLike) -> dict[str, Any]:
    """A ``metrics.json`` (or a folder holding one) read back and checked: JSON, this
    version, every key, the settings :data:`COMPARED_SETTINGS`, rows as lists of objects."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise MetricsError(
            f"{path}: no such file (expected a compare folder or a study's folder with "
            f"{METRICS_FILE})"
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise MetricsError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(record, dict):
        raise MetricsError(f"{path}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in _KEYS if k not in record]
    if missing:
        raise MetricsError(f"{path}: not a kvdiverge metrics file (no {', '.join(missing)})")
    if record["version"] != METRICS_VERSION:
        raise MetricsError(
            f"{path}: metrics version {record['version']!r}, expected {METRICS_VERSION}"
        )
    settings = record["settings"]
    if not isinstance(settings, dict) or any(k not in settings for k in COMPARED_SETTINGS):
        raise MetricsError(f"{path}: settings lack one of {', '.join(COMPARED_SETTINGS)}")
    for key in ("estimands", "contrasts", "accuracy"):
        rows = record[key]
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise MetricsError(f"{path}: {key!r} is not a list of rows")
    record["path"] = str(path)
    return record
