"""The pipeline's decoding temperature (``rollout.temperature``): its checks
and what it implies for the studies' replicates, run at parse time by
:func:`kvdiverge.config.check_config`. The one rule that ties a study's replicates to the
temperature is the schema's (``workflow/schemas/config.schema.yaml``): ``K_dev`` is at least
2 unless ``rollout.temperature`` is 0, since the plan needs the within-document variance.

The rollout jobs' kernels are softmax(logits / T) (``RolloutSettings.temperature``; the SWRB
jobs' ``temperature``, at T > 0 only); T = 1 is the model's own law (the paper's setting) and
T = 0 is greedy decoding, the point mass on the argmax. At T = 0 every replicate of a document
is the same path, so more than one replicate buys nothing: every study runs
K = K_dev = K_control = 1 (:func:`greedy_replicates`, one note line per study that asked for
more), and the sample-size plan, whose within-document variance is then exactly 0, accepts one
development path per document (:func:`kvdiverge.analysis.planning.development_paths`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "decoding_problem",
    "greedy_replicates",
    "rollout_temperature",
    "temperature_value_problem",
]


def rollout_temperature(config: Mapping[str, Any]) -> float:
    """``rollout.temperature`` of a config (1, the default, where it is absent)."""
    return config.get("rollout", {}).get("temperature", 1.0)


def temperature_value_problem(T: Any, field: str) -> str | None:
    """The one line ``<field>: expected a finite number >= 0 (0: greedy), got ...`` for a
    decoding temperature that is not one (a bool, NaN, infinite or negative), or None. The
    config's ``rollout.temperature`` and ``kvdiverge compare --temperature`` both take it."""
    if isinstance(T, bool) or not isinstance(T, int | float) or not math.isfinite(T) or T < 0:
        return f"{field}: expected a finite number >= 0 (0: greedy), got {T!r}"
    return None


def decoding_problem(config: Mapping[str, Any]) -> str | None:
    """The one line refusing a temperature the rollouts cannot run, or None: not a
    finite number >= 0, SWRB (``rollout.coupling: swrb``) at T = 0, and
    ``rollout.max_batch_rows: auto`` under SWRB (the memory plan that sizes it counts the
    shared-reference rows). (``K_dev`` 1 away from T = 0 is the schema's refusal.)

    SWRB runs at every T > 0 (its kernels are softmax(logits / T), as the other couplings').
    At T = 0 the kernels are point masses, so e_s ∈ {0, 1}, the trunk is the greedy path itself
    and M = 1{τ ≤ H}: the trunk has nothing to branch, and the shared-reference coupling already
    gives greedy decoding's exact answer with one path per document."""
    T = rollout_temperature(config)
    if problem := temperature_value_problem(T, "config.rollout.temperature"):
        return problem
    if T == 0 and config.get("rollout", {}).get("coupling") == "swrb":
        return (
            "config.rollout.temperature: 0 (greedy), but rollout.coupling swrb needs T > 0: "
            "greedy kernels are point masses, so the SWRB trunk has nothing to branch; expected "
            "a temperature > 0, or coupling shared-reference, which covers greedy decoding"
        )
    rollout = config.get("rollout", {})
    if rollout.get("coupling") == "swrb" and rollout.get("max_batch_rows") == "auto":
        return (
            "config.rollout.max_batch_rows: auto, but rollout.coupling swrb has no memory plan "
            "to size it to the device (the plan counts the shared-reference rows); expected an "
            "integer >= 3"
        )
    return None


def greedy_replicates(config: dict[str, Any]) -> list[str]:
    """At ``rollout.temperature`` 0, set every study's K, K_dev and K_control to 1 in place;
    return one note line per study that asked for more (none at T != 0)."""
    if rollout_temperature(config) != 0:
        return []
    notes = []
    for study, spec in config.get("studies", {}).items():
        asked = [f"{key} {spec[key]}" for key in ("K", "K_dev", "K_control") if spec.get(key) != 1]
        for key in ("K", "K_dev", "K_control"):
            spec[key] = 1
        if asked:
            notes.append(
                f"config.studies.{study}: rollout.temperature 0 (greedy): every replicate is the "
                f"same path, so K = K_dev = K_control = 1 (not {', '.join(asked)})"
            )
    return notes
