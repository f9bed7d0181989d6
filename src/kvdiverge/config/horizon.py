"""What a config's horizon ``rollout.H`` implies, checked at parse time: room for it in every
prompt (``datasets.generation_reserve``), the analysis clock's step counts at it
(``analysis.clock``), and the family estimands named on that clock
(``analysis.family_estimands``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvdiverge.config.errors import ConfigError

__all__ = [
    "check_clock",
    "check_family_estimands",
    "check_generation_reserve",
    "clock_problem",
]


def check_generation_reserve(config: Mapping[str, Any]) -> None:
    """Every prompt must leave room for the horizon: ``datasets.generation_reserve`` ≥
    ``rollout.H`` (RULER's budget rule n + tokens_to_generate ≤ target length).

    Raises :class:`~kvdiverge.config.errors.ConfigError` in one line otherwise. A larger
    reserve is allowed (shorter prompts than the stratum's length would admit).
    """
    reserve = config.get("datasets", {}).get("generation_reserve")
    horizon = config.get("rollout", {}).get("H")
    if reserve is not None and horizon is not None and reserve < horizon:
        raise ConfigError(
            f"config.datasets.generation_reserve: {reserve} leaves less room than the "
            f"rollout.H = {horizon} generated tokens; expected an integer >= {horizon}"
        )


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


_CLOCK_FIELDS = {
    "branch_depth": "branch_depth",
    "window": "window",
    "prefix": "prefix",
    "agreement_run": "agreement_run",
    "blocks": "block_edges",
}


def check_clock(config: Mapping[str, Any]) -> Any:
    """The analysis clock at ``rollout.H`` (every step count in range); returns it
    (:class:`~kvdiverge.analysis.statistic_registry.Clock`)."""
    from kvdiverge.analysis.document_stats import AnalysisInputError, Clock, clock_terms

    horizon = config.get("rollout", {}).get("H", 128)
    settings = dict(config.get("analysis", {}).get("clock", {}))
    try:
        return Clock.for_horizon(horizon, **settings)
    except AnalysisInputError as exc:
        text = str(exc).removeprefix("clock: ")
        name = text.split()[0]
        key = _CLOCK_FIELDS.get(name, "H")
        fraction, smallest = clock_terms(key, horizon, settings)
        raise ConfigError(clock_problem(horizon, name, fraction, text, smallest, key)) from exc


def check_family_estimands(config: Mapping[str, Any], clock: Any) -> None:
    """Each of ``analysis.family_estimands`` is a per-action estimand on ``clock``."""
    import numpy as np

    from kvdiverge.analysis.estimands import action_estimands

    class _Zeros(dict):
        def __missing__(self, key: str) -> np.ndarray:
            return np.zeros(1)

    known = action_estimands(_Zeros(), clock, 1)
    for name in config.get("analysis", {}).get("family_estimands", []):
        if name not in known:
            examples = ", ".join(k for k in known if "@" not in k)
            raise ConfigError(
                f"config.analysis.family_estimands: {name!r} is not a per-action estimand "
                f"(e.g. {examples})"
            )
