"""Every parse-time check of a run's configuration, in order (``workflow/rules/common.smk``
runs :func:`check_config` once, before any job; ``docs/configuration.md``, "Reading and
checking"). Each check raises :class:`~kvdiverge.config.errors.ConfigError` with one line:

1. the YAML files the config was read from: none a YTE template, each read strictly
   (:mod:`kvdiverge.config.reading`);
2. every name (models, actions, studies, rollout groups, strata; :mod:`kvdiverge.config.names`):
   names become paths, so they are checked before anything else;
3. every value's kind and range against the schema, defaults filled in place
   (:mod:`kvdiverge.config.schema`);
4. the cross-references (:func:`check_references`): the generation reserve against H; the
   actions' budget sweeps expanded in place and their labels, the decoding temperature, the
   studies' baselines and bootstrap draws (:mod:`kvdiverge.config.actions`,
   :mod:`kvdiverge.config.temperature`, :mod:`kvdiverge.config.baselines`); extreme values
   (:mod:`kvdiverge.config.bounds`); the finite-state study's EOS token and figure
   systems; the models (:mod:`kvdiverge.config.models`); the actions parsed; the studies, their
   rollout groups and contrasts (:mod:`kvdiverge.config.studies`); the length tokenizer; the
   analysis clock and the family estimands at H (:mod:`kvdiverge.config.horizon`); the
   actions' budgets against the strata's prompt lengths;
5. at ``rollout.temperature`` 0, K = K_dev = K_control = 1 in place, one note per study that
   asked for more (:func:`~kvdiverge.config.temperature.greedy_replicates`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from kvdiverge.analysis.bootstrap import bootstrap_draws_problem
from kvdiverge.config.actions import actions_problem, check_budgets, configured_actions
from kvdiverge.config.baselines import baseline_problem
from kvdiverge.config.bounds import extremes_problem
from kvdiverge.config.errors import ConfigError
from kvdiverge.config.horizon import check_clock, check_family_estimands, check_generation_reserve
from kvdiverge.config.models import check_length_tokenizer, check_models
from kvdiverge.config.names import config_name_problem
from kvdiverge.config.reading import TEMPLATING_REFUSED, load_yaml_strict, templated
from kvdiverge.config.schema import validate_config
from kvdiverge.config.studies import check_analysis_references, check_studies, check_swrb_groups
from kvdiverge.config.temperature import decoding_problem, greedy_replicates

__all__ = ["check_config", "check_references"]


def _check_finite_state(config: Mapping[str, Any]) -> None:
    """The finite-state study's combinations (EOS needs a third token, figure systems exist)."""
    from kvdiverge.theory.finite_state_study import family_parameters

    try:
        family_parameters(config)
    except ValueError as exc:
        if str(exc).startswith("config."):
            raise ConfigError(str(exc).replace("\n", " ")) from exc
        raise


def check_references(config: Mapping[str, Any]) -> None:
    """Resolve every cross-reference of a schema-checked config (step 4 of the module
    docstring, in that order); :class:`~kvdiverge.config.errors.ConfigError` in one line
    naming the field."""
    check_generation_reserve(config)
    checks = (actions_problem, decoding_problem, baseline_problem, bootstrap_draws_problem)
    if problem := next(filter(None, (check(config) for check in checks)), None):
        raise ConfigError(problem)
    if problem := extremes_problem(config):
        raise ConfigError(problem)
    _check_finite_state(config)
    check_models(config)
    actions = configured_actions(config)
    check_studies(config, actions)
    check_swrb_groups(config)
    check_analysis_references(config)
    check_length_tokenizer(config)
    clock = check_clock(config)
    check_family_estimands(config, clock)
    check_budgets(config, actions)


def check_config(
    config: dict[str, Any],
    schema: Mapping[str, Any] | str | os.PathLike,
    files: Iterable[str | os.PathLike] = (),
) -> list[str]:
    """Every parse-time check of the run's configuration, in the module docstring's order:
    the YAML ``files`` it was read from, the names, the values against ``schema`` (defaults
    filled in place), the cross-references. Raises
    :class:`~kvdiverge.config.errors.ConfigError` in one line. Returns the notes of
    :func:`~kvdiverge.config.temperature.greedy_replicates` (K = 1 at temperature 0, in place)."""
    for path in files:
        if templated(path):  # Snakemake has evaluated it already (docs/configuration.md)
            raise ConfigError(f"{path}: {TEMPLATING_REFUSED}")
        load_yaml_strict(path)
    bad_name = config_name_problem(config)  # names become paths: checked before anything else
    if bad_name:
        raise ConfigError(bad_name)
    validate_config(config, schema)
    check_references(config)
    return greedy_replicates(config)
