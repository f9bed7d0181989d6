"""Bounds on a config's extreme values, refused at parse time in one line naming the field
(:func:`kvdiverge.config.check_config`), so that none fails later with NaN files or a memory
traceback.

* ``rollout.temperature``: 0 (greedy) or at least :data:`MIN_TEMPERATURE`. The kernels are
  softmax(logits / T) in float64 (``kvdiverge.theory.coupling.tempered_kernel``): as T nears 0,
  logits / T overflows to ±inf (at T = 1e-320 every finite logit does) and the kernel is NaN,
  and long before that the law is the argmax up to rounding, which T = 0 computes exactly.
* replicates (``K``, ``K_dev``, ``K_control`` of a study, ``analysis.planning.max_K``): one
  trajectory file of an action and stratum holds K · H · n rows for n documents of a cohort,
  and a table holds at most :data:`MAX_FILE_ROWS` rows (polars' row index; the ``replicate``
  column is a 32-bit integer). The bound is checked with the largest cohort of
  ``datasets.cohorts``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAX_FILE_ROWS",
    "MIN_TEMPERATURE",
    "clock_problem",
    "extremes_problem",
    "temperature_problem",
]

MIN_TEMPERATURE = 1e-6
"""The smallest decoding temperature other than 0 (module docstring)."""
MAX_FILE_ROWS = 2**32 - 1
"""The most rows one trajectory file may hold (module docstring)."""
_REPLICATES = ("K", "K_dev", "K_control")


def temperature_problem(T: Any, field: str) -> str | None:
    """The one line refusing a temperature ``T`` other than 0 below :data:`MIN_TEMPERATURE`
    (``field`` names it), or None (other values are checked where they are read)."""
    if isinstance(T, bool) or not isinstance(T, int | float) or not math.isfinite(T):
        return None
    if 0 < T < MIN_TEMPERATURE:
        return (
            f"{field}: {T!r} is below {MIN_TEMPERATURE:g}; expected 0 (greedy) or a temperature "
            f">= {MIN_TEMPERATURE:g}: below it softmax(logits / T) is the argmax up to rounding, "
            "and as T nears 0 logits / T overflow (NaN kernels); use 0 for greedy decoding"
        )
    return None


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


def clock_problem(
    H: int, key: str, fraction: Any, text: str, smallest: int | None, field: str
) -> str:
    """The line refusing ``rollout.H`` for the analysis clock, in the user's own terms: the
    H they wrote, the clock's fraction ``key`` (``analysis.clock.<field>``, a fraction of H)
    whose step count ``text`` refuses (``"<key> must lie in ..., got N"``), and the smallest H
    that works with the same fractions (``smallest``; None when none does nearby)."""
    rule, _, derived = text.rpartition(", got ")
    steps = "step" if derived == "1" else "steps"
    made = f"makes {derived} {steps}, and " if rule and key != "H" else ""
    rule = rule or text
    what = f"analysis.clock.{field} {fraction!r} (a fraction of H) {made}" if made else ""
    fix = f"rollout.H >= {smallest}" if smallest is not None else "a longer rollout.H"
    other = f", or another analysis.clock.{field}" if made else ""
    return (
        f"config.rollout.H: {H} is too short for the analysis clock: {what}{rule}; expected "
        f"{fix}{other}"
    )
