"""Bounds on a config's extreme values, refused at parse time in one line naming the field
(:func:`kvdiverge.config.check_config`), so that none fails later with NaN files or a memory
traceback; the bounds themselves are :mod:`kvdiverge.pipeline.extremes`'s, which the engine and
``kvdiverge compare`` read too.

* ``rollout.temperature``: 0 (greedy) or at least
  :data:`~kvdiverge.pipeline.extremes.MIN_TEMPERATURE`;
* replicates (``K``, ``K_dev``, ``K_control`` of a study, ``analysis.planning.max_K``): K · H · n
  rows of one trajectory file for the n documents of a cohort, at most
  :data:`~kvdiverge.pipeline.extremes.MAX_FILE_ROWS`, checked with the largest cohort of
  ``datasets.cohorts``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvdiverge.pipeline.extremes import MAX_FILE_ROWS, temperature_problem

__all__ = ["extremes_problem"]

_REPLICATES = ("K", "K_dev", "K_control")


def _largest_cohort(config: Mapping[str, Any]) -> tuple[str, int] | None:
    cohorts = config.get("datasets", {}).get("cohorts") or {}
    sizes = [(name, n) for name, n in cohorts.items() if isinstance(n, int) and n > 0]
    return max(sizes, key=lambda item: item[1]) if sizes else None


def _replicates_problem(value: Any, field: str, H: int, cohort: tuple[str, int]) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    name, n = cohort
    rows = value * H * n
    if rows <= MAX_FILE_ROWS:
        return None
    bound = MAX_FILE_ROWS // (H * n)
    return (
        f"{field}: {value} replicates of the {n} documents of cohort {name} at rollout.H = {H} "
        f"are {rows} rows in one trajectory file; expected at most {bound} replicates (a file "
        f"holds at most {MAX_FILE_ROWS} rows)"
    )


def extremes_problem(config: Mapping[str, Any]) -> str | None:
    """The first extreme value of a schema-checked config (module docstring) as one line
    naming its field, or None."""
    rollout = config.get("rollout", {})
    T = rollout.get("temperature", 1.0)
    if problem := temperature_problem(T, "config.rollout.temperature"):
        return problem
    H = rollout.get("H", 128)
    cohort = _largest_cohort(config)
    if not isinstance(H, int) or isinstance(H, bool) or H < 1 or cohort is None:
        return None
    for study, spec in (config.get("studies") or {}).items():
        for key in _REPLICATES:
            field = f"config.studies.{study}.{key}"
            if problem := _replicates_problem(spec.get(key), field, H, cohort):
                return problem
    max_K = config.get("analysis", {}).get("planning", {}).get("max_K")
    return _replicates_problem(max_K, "config.analysis.planning.max_K", H, cohort)
