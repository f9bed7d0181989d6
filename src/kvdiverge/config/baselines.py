"""A study's ``baseline`` (``studies.<study>.baseline``): the action every
other compared action of the study is set against in its ``contrasts.{csv,md}`` and
``summary.md`` (rule study_contrasts; :mod:`kvdiverge.tables.contrasts`). Checked at parse time
by :func:`kvdiverge.config.check_config`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvdiverge.config.actions import budget_sweeps

__all__ = ["baseline_contrasts", "baseline_pairs", "baseline_problem"]


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


def baseline_pairs(config: Mapping[str, Any], study: str) -> dict[str, str]:
    """Each compared action of a study with a baseline → the action it is set against; {}
    without a baseline. When the baseline's method runs at several budgets of the study
    (:func:`kvdiverge.config.actions.budget_sweeps`, e.g. ``snapkv`` with ``budgets``), the
    grid is paired: each swept action is set against the baseline's method at its own
    budget (``mine@0.25 - snapkv@0.25``), and the baseline's own budgets are no contrast; an
    action at a budget the baseline's method lacks, and every action outside the sweep, is
    set against the baseline as named."""
    spec = config["studies"][study]
    baseline = spec.get("baseline")
    if baseline is None:
        return {}
    control = spec.get("control", "full")
    sweep = budget_sweeps(config, study)
    method = sweep.get(baseline, (None, None))[0]
    base_at = {b: a for a, (m, b) in sweep.items() if method is not None and m == method}
    out = {}
    for a in spec["actions"]:
        if a in (control, baseline) or a in base_at.values():
            continue
        budget = sweep[a][1] if a in sweep else None
        out[a] = base_at.get(budget, baseline) if budget is not None else baseline
    return out


def baseline_contrasts(config: Mapping[str, Any], study: str) -> list[list[str]]:
    """The contrasts [a, its baseline] (estimands rows ``a - baseline``) of every compared
    action of a study with a baseline (:func:`baseline_pairs`); [] without one."""
    return [[a, b] for a, b in baseline_pairs(config, study).items()]
