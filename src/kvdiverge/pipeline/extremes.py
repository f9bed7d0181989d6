"""Bounds on extreme values that the layers share: the smallest decoding temperature other
than 0 (:data:`MIN_TEMPERATURE`, :func:`temperature_problem`, read by the engine's settings,
the config's checks and ``kvdiverge compare``) and the most rows one trajectory file may hold
(:data:`MAX_FILE_ROWS`). A config's values are checked against them at parse time by
:mod:`kvdiverge.config.bounds`.

* ``rollout.temperature``: 0 (greedy) or at least :data:`MIN_TEMPERATURE`. The kernels are
  softmax(logits / T) in float64 (``kvdiverge.theory.coupling.tempered_kernel``): as T nears 0,
  logits / T overflows to ±inf (at T = 1e-320 every finite logit does) and the kernel is NaN,
  and long before that the law is the argmax up to rounding, which T = 0 computes exactly.
* replicates: one trajectory file of an action and stratum holds K · H · n rows for n
  documents of a cohort, and a table holds at most :data:`MAX_FILE_ROWS` rows (polars' row
  index; the ``replicate`` column is a 32-bit integer).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MAX_FILE_ROWS", "MIN_TEMPERATURE", "temperature_problem"]

MIN_TEMPERATURE = 1e-6
"""The smallest decoding temperature other than 0 (module docstring)."""
MAX_FILE_ROWS = 2**32 - 1
"""The most rows one trajectory file may hold (module docstring)."""


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
