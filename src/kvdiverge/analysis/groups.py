"""Rollout groups of a study (docs/compare.md, "Rollout groups"): which of its actions share an
evaluation job, and which group each action belongs to.

A study's ``groups`` (config ``studies.<study>.groups``) split its actions; without them the
study is one group :data:`FIRST_GROUP` of every action. The config's checks of the groups are in
:mod:`kvdiverge.config.studies` (which re-exports these names from :mod:`kvdiverge.config`);
this module imports nothing of the package, so that the lock code
(:mod:`kvdiverge.analysis.prespecification`) reaches no other module through it (a rule's code
fingerprint covers every module its script reaches; docs/architecture.md, "Reruns").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["FIRST_GROUP", "action_groups", "study_groups"]

FIRST_GROUP = "main"
"""The name of a study's one rollout group when its config lists no ``groups``."""


def study_groups(config: Mapping[str, Any], study: str) -> dict[str, list[str]]:
    """The study's rollout groups in config order, group name → its actions (in the study's
    action order): ``studies.<study>.groups``, else one group :data:`FIRST_GROUP` holding every
    action. Each group's actions run in one evaluation job per model and stratum; the first
    group's development rollouts plan the study's K and its lock is the study's lock
    (docs/compare.md, "Rollout groups")."""
    spec = config["studies"][study]
    groups = spec.get("groups") or {FIRST_GROUP: list(spec["actions"])}
    return {
        group: [a for a in spec["actions"] if a in members] for group, members in groups.items()
    }


def action_groups(config: Mapping[str, Any], study: str) -> dict[str, str]:
    """The group of each of the study's actions (:func:`study_groups`), by action name."""
    return {a: g for g, members in study_groups(config, study).items() for a in members}
