"""A config's studies (``studies.<study>``; ``docs/configuration.md``, "Studies") and the
names that point into them: each study's actions, control, rollout groups and cohort, its
family, and its contrasts.

* :func:`check_studies`: a study's actions and control are configured actions, the control
  keeps every entry and has company, its ``groups`` split its actions (:func:`check_groups`),
  its cohort exists (not ``dev``) with documents, the development cohort has the two documents
  per stratum the plan needs, and a family size of at least the family's endpoints;
* :func:`check_swrb_groups`: no rollout groups under ``rollout.coupling: swrb``;
* :func:`study_contrasts`: a study's contrasts [b, a] (``analysis.contrasts``, else every pair
  of its compared actions, earlier minus later), and :func:`check_analysis_references` of every
  name in ``analysis.contrasts``, ``analysis.prediction.pairs`` and
  ``figures.main_contrast``.

A study's rollout groups themselves (:func:`~kvdiverge.analysis.groups.study_groups`,
:func:`~kvdiverge.analysis.groups.action_groups`, :data:`~kvdiverge.analysis.groups.FIRST_GROUP`)
live in :mod:`kvdiverge.analysis.groups`, below this layer, because the study's lock
(:mod:`kvdiverge.analysis.prespecification`) reads them; :mod:`kvdiverge.config` re-exports
them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvdiverge.analysis.groups import action_groups, study_groups
from kvdiverge.config.errors import ConfigError
from kvdiverge.eviction import ActionSpec, keeps_everything

__all__ = [
    "check_analysis_references",
    "check_groups",
    "check_studies",
    "check_swrb_groups",
    "compared_actions",
    "study_contrasts",
]


def _names(items: Iterable[str]) -> str:
    return ", ".join(items) or "none configured"


def check_groups(where: str, spec: Mapping[str, Any], control: str) -> None:
    """A study's ``groups`` split its actions: every action in exactly one group, the control
    and at least one other action in the first (whose development rollouts plan K)."""
    groups = spec.get("groups") or {}
    if not groups:
        return
    seen: dict[str, str] = {}
    for group, members in groups.items():
        if not members:
            raise ConfigError(f"{where}.groups.{group}: an empty group; expected its actions")
        for name in members:
            if name not in spec["actions"]:
                raise ConfigError(
                    f"{where}.groups.{group}: {name!r} is not one of the study's actions "
                    f"({_names(spec['actions'])})"
                )
            if name in seen:
                raise ConfigError(
                    f"{where}.groups.{group}: {name!r} is already in group {seen[name]!r}; an "
                    "action belongs to one group"
                )
            seen[name] = group
    missing = [a for a in spec["actions"] if a not in seen]
    if missing:
        raise ConfigError(
            f"{where}.groups: action(s) {_names(missing)} in no group; expected every action of "
            "the study in one group"
        )
    first, members = next(iter(groups.items()))
    if seen[control] != first:
        raise ConfigError(
            f"{where}.groups.{seen[control]}: holds the control {control!r}, which belongs in "
            f"the first group {first!r} (its development rollouts plan the study's K)"
        )
    if not [a for a in members if a != control]:
        raise ConfigError(
            f"{where}.groups.{first}: expected at least one action besides the control "
            f"{control!r} (the first group's development rollouts plan the study's K)"
        )


def check_studies(config: Mapping[str, Any], actions: Mapping[str, ActionSpec]) -> None:
    """Every study's actions, control, groups, cohort and family size against the parsed
    ``actions`` and the configured cohorts (module docstring); one
    :class:`~kvdiverge.config.errors.ConfigError` line naming the study's field."""
    cohorts = config.get("datasets", {}).get("cohorts", {})
    for study, spec in config.get("studies", {}).items():
        where = f"config.studies.{study}"
        for name in spec["actions"]:
            if name not in actions:
                raise ConfigError(
                    f"{where}.actions: {name!r} is not in config.actions ({_names(actions)})"
                )
        control = spec.get("control", "full")
        if control not in actions:
            raise ConfigError(
                f"{where}.control: {control!r} is not in config.actions ({_names(actions)})"
            )
        if control not in spec["actions"]:
            raise ConfigError(
                f"{where}.control: {control!r} is not one of the study's actions "
                f"({_names(spec['actions'])})"
            )
        if not keeps_everything(actions[control]):
            raise ConfigError(
                f"{where}.control: {control!r} uses selector {actions[control].selector!r}; the "
                "control must keep every entry (selector full)"
            )
        if not [a for a in spec["actions"] if a != control]:
            raise ConfigError(
                f"{where}.actions: expected at least one action besides the control {control!r}"
            )
        check_groups(where, spec, control)
        cohort = spec.get("cohort", study)
        field = f"{where}.cohort" if "cohort" in spec else f"{where} (its cohort is its name)"
        if cohort == "dev":
            raise ConfigError(
                f"{field}: 'dev' is the development cohort every study runs; expected an "
                f"evaluation cohort ({', '.join(c for c in cohorts if c != 'dev')})"
            )
        if cohort not in cohorts:
            raise ConfigError(
                f"{field}: no cohort {cohort!r} in config.datasets.cohorts "
                f"({_names(c for c in cohorts if c != 'dev')}); set {where}.cohort"
            )
        if cohorts[cohort] < 1:
            raise ConfigError(
                f"config.datasets.cohorts.{cohort}: 0 documents per stratum, but study "
                f"{study!r} evaluates on cohort {cohort!r}; expected an integer >= 1"
            )
        n_dev = cohorts.get("dev", 0)
        if n_dev < 2:
            raise ConfigError(
                f"config.datasets.cohorts.dev: {n_dev} document{'s' if n_dev != 1 else ''} per "
                f"stratum, but study {study!r} plans its evaluation from the variance between "
                "development documents within a stratum; expected an integer >= 2"
            )
        family = spec.get("family_endpoints", 1)
        endpoints = (
            len(config.get("models", {}))
            * len([a for a in spec["actions"] if a != control])
            * len(config.get("analysis", {}).get("family_estimands", []))
        )
        if family > 1 and family < endpoints:
            raise ConfigError(
                f"{where}.family_endpoints: {family}, but the study's family has {endpoints} "
                "endpoints (analysis.family_estimands x non-control actions x models), so "
                f"1 - alpha/{family} would not hold for the family; expected an integer >= "
                f"{endpoints}"
            )


def check_swrb_groups(config: Mapping[str, Any]) -> None:
    """``rollout.coupling: swrb`` runs every action of a study under the study's one lock, and
    its estimands table reads that lock alone: a study split into rollout groups (an
    amendment lock per later group) is refused."""
    if config.get("rollout", {}).get("coupling") != "swrb":
        return
    for study, spec in config.get("studies", {}).items():
        if len(spec.get("groups") or {}) > 1:
            raise ConfigError(
                f"config.studies.{study}.groups: rollout groups need rollout.coupling "
                "shared-reference or independent; swrb runs a study's actions under its one "
                'lock (docs/swrb.md, "Switching it on")'
            )


def compared_actions(config: Mapping[str, Any], study: str) -> list[str]:
    """The study's actions other than its control, in the study's order."""
    spec = config["studies"][study]
    return [a for a in spec["actions"] if a != spec.get("control", "full")]


def _check_pair(config: Mapping[str, Any], where: str, study: str, pair: Any) -> None:
    compared = compared_actions(config, study)
    if len(pair) != 2 or pair[0] == pair[1] or any(a not in compared for a in pair):
        raise ConfigError(
            f"{where}: expected [b, a], two different non-control actions of the study "
            f"({', '.join(compared)}), got {list(pair)}"
        )


def study_contrasts(config: Mapping[str, Any], study: str) -> list[list[str]]:
    """The study's contrasts [b, a] (analysis.contrasts, else every pair of non-control
    actions, earlier minus later)."""
    compared = compared_actions(config, study)
    pairs = [[b, a] for i, b in enumerate(compared) for a in compared[i + 1 :]]
    given = config.get("analysis", {}).get("contrasts", {}).get(study)
    return [list(p) for p in (given or pairs)]


def check_analysis_references(config: Mapping[str, Any]) -> None:
    """Every study named by ``analysis.contrasts``, ``analysis.prediction.pairs`` and
    ``figures.main_contrast`` exists; each pair is two different compared actions of it; a
    prediction pair runs in the study's first rollout group and has the two development
    documents cross-validation needs; a main contrast is one of the study's contrasts."""
    studies = config.get("studies", {})
    analysis = config.get("analysis", {})
    for section, field in (
        (analysis.get("contrasts", {}), "config.analysis.contrasts"),
        (analysis.get("prediction", {}).get("pairs", {}), "config.analysis.prediction.pairs"),
        (config.get("figures", {}).get("main_contrast", {}), "config.figures.main_contrast"),
    ):
        for study in section:
            if study not in studies:
                raise ConfigError(f"{field}: no study named {study!r} ({_names(studies)})")
    for study, pairs in analysis.get("contrasts", {}).items():
        for i, pair in enumerate(pairs):
            _check_pair(config, f"config.analysis.contrasts.{study}[{i}]", study, pair)
    dev = config.get("datasets", {}).get("cohorts", {}).get("dev", 0)
    n_strata = len(config.get("datasets", {}).get("strata", []))
    for study, pair in analysis.get("prediction", {}).get("pairs", {}).items():
        if not pair:
            continue
        _check_pair(config, f"config.analysis.prediction.pairs.{study}", study, pair)
        groups = study_groups(config, study)
        first = next(iter(groups))
        for action in pair:
            if action not in groups[first]:
                raise ConfigError(
                    f"config.analysis.prediction.pairs.{study}: {action!r} is in rollout group "
                    f"{action_groups(config, study)[action]!r}, but prediction is fitted on the "
                    f"development rollouts, which only the first group ({first!r}) runs"
                )
        if dev * n_strata < 2:
            raise ConfigError(
                f"config.datasets.cohorts.dev: prediction (config.analysis.prediction.pairs."
                f"{study}) cross-validates on at least 2 development documents, got "
                f"{dev * n_strata} ({dev} per stratum x {n_strata} strata)"
            )
    for study, pair in config.get("figures", {}).get("main_contrast", {}).items():
        if list(pair) not in study_contrasts(config, study):
            raise ConfigError(
                f"config.figures.main_contrast.{study}: expected one of the study's contrasts "
                f"{study_contrasts(config, study)} (config.analysis.contrasts), got {list(pair)}"
            )
