"""A study's ``baseline`` (``studies.<study>.baseline``): the action every
other compared action of the study is set against in its ``contrasts.{csv,md}`` and
``summary.md`` (rule study_contrasts; :mod:`kvdiverge.tables.contrasts`). Checked at parse time
by :func:`kvdiverge.config.check_config`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvdiverge.config.actions import budget_sweeps

__all__ = ["baseline_contrasts", "baseline_pairs", "baseline_problem", "paired_baselines"]


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


def paired_baselines(
    actions: Sequence[str],
    baseline: str | None,
    sweep: Mapping[str, tuple[str, float | int]],
    method: str | None,
) -> dict[str, str]:
    """Each compared action → the action it is set against: the rule of a paired grid, shared
    by a study's baseline (:func:`baseline_pairs`) and ``kvdiverge compare --baseline``
    (:func:`kvdiverge.compare.actions.contrast_pairs`). {} without a baseline.

    ``actions``: the compared actions in order (a study's without its control); ``sweep``: each
    swept action → (its method, its budget); ``method``: the baseline's method (None: not
    swept). The baseline's method at budget b is the action ``base_at[b]`` of ``sweep`` with
    that method. Then each action other than the baseline and the points ``base_at`` is set
    against ``base_at[b]`` when it is swept at a budget b the baseline's method has (a paired
    grid, every contrast at equal budget), and otherwise against the baseline as named when
    that is one of ``actions``, else against none (compare's swept baseline has no action of
    its own name left: an action outside the sweep then has no contrast)."""
    if baseline is None:
        return {}
    base_at = {b: a for a, (m, b) in sweep.items() if method is not None and m == method}
    fallback = baseline if baseline in actions else None
    out = {}
    for a in actions:
        if a == baseline or a in base_at.values():
            continue
        against = base_at.get(sweep[a][1]) if a in sweep else None
        against = against if against is not None else fallback
        if against is not None:
            out[a] = against
    return out


def baseline_pairs(config: Mapping[str, Any], study: str) -> dict[str, str]:
    """Each compared action of a study with a baseline → the action it is set against; {}
    without a baseline (:func:`paired_baselines`). When the baseline's method runs at several
    budgets of the study (:func:`kvdiverge.config.actions.budget_sweeps`, e.g. ``snapkv`` with
    ``budgets``), the grid is paired: each swept action is set against the baseline's method at
    its own budget (``mine@0.25 - snapkv@0.25``), and the baseline's own budgets are no
    contrast; an action at a budget the baseline's method lacks, and every action outside the
    sweep, is set against the baseline as named."""
    spec = config["studies"][study]
    baseline = spec.get("baseline")
    control = spec.get("control", "full")
    sweep = budget_sweeps(config, study) if baseline is not None else {}
    method = sweep.get(baseline, (None, None))[0]
    compared = [a for a in spec["actions"] if a != control]
    return paired_baselines(compared, baseline, sweep, method)


def baseline_contrasts(config: Mapping[str, Any], study: str) -> list[list[str]]:
    """The contrasts [a, its baseline] (estimands rows ``a - baseline``) of every compared
    action of a study with a baseline (:func:`baseline_pairs`); [] without one."""
    return [[a, b] for a, b in baseline_pairs(config, study).items()]
