"""The configuration in one place: how a run's config is read, what its schema fills in and
refuses, how its names point at each other, and what its actions, decoding temperature,
models, studies and baselines mean. The pipeline's rules (``workflow/rules/*.smk``) read it
from here, and ``kvdiverge compare`` the rules it shares (a temperature, a sweep's budgets, a
label, the pairs of a paired grid: :func:`temperature_value_problem`, :func:`is_budget`,
:func:`label_problem`, :func:`paired_baselines`); a run's config is checked once at parse
time (:func:`check_config`), one :class:`ConfigError` line naming the field or file.

Modules, one concept each:

* ``errors`` — :class:`ConfigError`.
* ``reading`` — config files read strictly (duplicate keys, YAML 1.1 booleans and integers
  refused; :func:`load_yaml_strict`, :func:`load_schema`) and as data (YTE templating refused:
  :func:`templated`).
* ``schema`` — kinds and ranges against ``workflow/schemas/config.schema.yaml``, defaults
  filled in place (:func:`validate_config`).
* ``names`` — the one pattern of model, action, study, group and stratum names; the one rule of
  display labels (:func:`label_problem`); escaped wildcard constraints
  (:func:`wildcard_alternation`).
* ``models`` — each model's folder (:func:`model_path`) and its form checked.
* ``actions`` — the action entries parsed (:func:`configured_actions`), their budgets against
  the strata, display labels and budget sweeps (:func:`action_labels`,
  :func:`budget_sweeps`).
* ``temperature`` — the decoding temperature and what greedy decoding does to the replicates.
* ``studies`` — studies, their controls, rollout groups, cohorts and families; their contrasts
  (:func:`study_contrasts`) and every name pointing into them.
* ``baselines`` — a study's baseline and the pairs set against it (:func:`baseline_pairs`, by
  the rule of a paired grid that ``kvdiverge compare`` shares: :func:`paired_baselines`).
* ``horizon`` — what ``rollout.H`` implies: the generation reserve, the analysis clock, the
  family estimands.
* ``bounds`` — a config's extreme values (a temperature near 0, replicates beyond a trajectory
  file's rows) against the bounds of :mod:`kvdiverge.pipeline.extremes`.
* ``parse_checks`` — every check in order: :func:`check_config`, :func:`check_references`.

Two pieces stay below this layer because lower layers read them, and are re-exported here: a
study's rollout groups (:mod:`kvdiverge.analysis.groups`, read by the study's lock) and an
action entry's selector part (:func:`kvdiverge.eviction.selector_entry`, read by the memory
plan). The bounds on extreme values themselves (:mod:`kvdiverge.pipeline.extremes`) stay in
the pipeline layer: the engine's settings and ``kvdiverge compare`` read them too.
"""

from __future__ import annotations

from kvdiverge.analysis.groups import FIRST_GROUP, action_groups, study_groups
from kvdiverge.config.actions import (
    DISPLAY_KEYS,
    action_labels,
    actions_problem,
    budget_sweeps,
    budget_text,
    check_budgets,
    configured_actions,
    is_budget,
    selector_entry,
)
from kvdiverge.config.baselines import (
    baseline_contrasts,
    baseline_pairs,
    baseline_problem,
    paired_baselines,
)
from kvdiverge.config.bounds import extremes_problem
from kvdiverge.config.errors import ConfigError
from kvdiverge.config.horizon import (
    check_clock,
    check_family_estimands,
    check_generation_reserve,
    clock_problem,
)
from kvdiverge.config.models import BUILT_MODELS, check_length_tokenizer, check_models, model_path
from kvdiverge.config.names import (
    MAX_LABEL,
    NAME_PATTERN,
    NAME_RULE,
    config_name_problem,
    label_problem,
    name_problem,
    wildcard_alternation,
)
from kvdiverge.config.parse_checks import check_config, check_references
from kvdiverge.config.reading import (
    TEMPLATING_KEY,
    TEMPLATING_REFUSED,
    load_schema,
    load_yaml_strict,
    templated,
)
from kvdiverge.config.schema import validate_config
from kvdiverge.config.studies import (
    check_analysis_references,
    check_groups,
    check_studies,
    check_swrb_groups,
    compared_actions,
    study_contrasts,
)
from kvdiverge.config.temperature import (
    decoding_problem,
    greedy_replicates,
    rollout_temperature,
    temperature_value_problem,
)

__all__ = [
    "BUILT_MODELS",
    "DISPLAY_KEYS",
    "FIRST_GROUP",
    "MAX_LABEL",
    "NAME_PATTERN",
    "NAME_RULE",
    "TEMPLATING_KEY",
    "TEMPLATING_REFUSED",
    "ConfigError",
    "action_groups",
    "action_labels",
    "actions_problem",
    "baseline_contrasts",
    "baseline_pairs",
    "baseline_problem",
    "budget_sweeps",
    "budget_text",
    "check_analysis_references",
    "check_budgets",
    "check_clock",
    "check_config",
    "check_family_estimands",
    "check_generation_reserve",
    "check_groups",
    "check_length_tokenizer",
    "check_models",
    "check_references",
    "check_studies",
    "check_swrb_groups",
    "clock_problem",
    "compared_actions",
    "config_name_problem",
    "configured_actions",
    "decoding_problem",
    "extremes_problem",
    "greedy_replicates",
    "is_budget",
    "label_problem",
    "load_schema",
    "load_yaml_strict",
    "model_path",
    "name_problem",
    "paired_baselines",
    "rollout_temperature",
    "selector_entry",
    "study_contrasts",
    "study_groups",
    "temperature_value_problem",
    "templated",
    "validate_config",
    "wildcard_alternation",
]
