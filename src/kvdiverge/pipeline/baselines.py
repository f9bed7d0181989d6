"""A study's ``baseline`` (``studies.<study>.baseline``; issue 31, item 2): the action every
other compared action of the study is set against in its ``contrasts.{csv,md}`` and
``summary.md`` (rule study_contrasts; :mod:`kvdiverge.tables.contrasts`). Checked at parse time
by :func:`kvdiverge.config.check_config`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["baseline_contrasts", "baseline_problem"]


def baseline_problem(config: Mapping[str, Any]) -> str | None:
    """The one line refusing a study's baseline, or None: it must be one of the study's
    actions other than its full-retention control (whose R_SMC is 0 by construction), with
    another compared action beside it."""
    for study, spec in config.get("studies", {}).items():
        baseline = spec.get("baseline")
        if baseline is None:
            continue
        control = spec.get("control", "full")
        compared = [a for a in spec.get("actions", []) if a != control]
        where = f"config.studies.{study}.baseline"
        if baseline not in compared:
            return (
                f"{where}: {baseline!r} is not a compared action of the study; expected one of "
                f"{', '.join(compared) or 'none'} (not the control {control!r})"
            )
        if len(compared) < 2:
            return (
                f"{where}: {baseline!r} is the study's only compared action; expected a study "
                "with another action to set against it"
            )
    return None


def baseline_contrasts(config: Mapping[str, Any], study: str) -> list[list[str]]:
    """The contrasts [a, baseline] (estimands rows ``a - baseline``) of every compared action
    of a study with a baseline; [] without one."""
    spec = config["studies"][study]
    baseline = spec.get("baseline")
    if baseline is None:
        return []
    control = spec.get("control", "full")
    return [[a, baseline] for a in spec["actions"] if a not in (control, baseline)]
