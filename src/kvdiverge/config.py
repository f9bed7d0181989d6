"""Configuration: strict reading, JSON-schema validation with defaults, cross-references.

Snakemake's own ``validate`` prints the whole schema on failure; a user editing ``config.yaml``
needs the field and what was expected, before any work starts. Everything here runs once at
parse time (``workflow/rules/common.smk``) and raises :class:`ConfigError` with one line:

* :func:`load_yaml_strict`: every YAML file the run reads (config files, the schema) is read
  strictly: a duplicate key, a YAML 1.1 boolean spelled ``yes``/``no``/``on``/``off`` and an
  integer in a YAML 1.1 form (``010``, ``1:30``) are errors, never silent coercions;
* :func:`validate_config`: kinds and ranges of every value (an integer field takes no ``4.0``
  and no ``true``), schema defaults filled in;
* :func:`check_references`: the actions' budget sweeps expanded in place and their labels
  (:mod:`kvdiverge.pipeline.actions`), every name that points at something else (actions,
  models, the studies' cohorts, controls and rollout groups, contrasts, prediction pairs,
  figure contrasts, family estimands, the length tokenizer) and every combination that would fail
  later (the analysis clock against ``rollout.H``, the generation reserve against H, the
  actions' budgets against the strata's prompt lengths, the development documents and
  replicates prediction and planning need, a family size of at least the family's
  endpoints, rollout groups under ``rollout.coupling: swrb``, the finite-state study's EOS
  token and figure systems);
* :func:`check_config`: all of the above, in that order.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import jsonschema
import yaml

from kvdiverge.analysis.bootstrap import bootstrap_draws_problem
from kvdiverge.analysis.groups import FIRST_GROUP, action_groups, study_groups
from kvdiverge.eviction import check_action, is_transform, keeps_everything
from kvdiverge.pipeline.actions import actions_problem, selector_entry
from kvdiverge.pipeline.baselines import baseline_problem
from kvdiverge.pipeline.configfiles import TEMPLATING_REFUSED, templated
from kvdiverge.pipeline.decoding import decoding_problem, greedy_replicates
from kvdiverge.pipeline.extremes import clock_problem, extremes_problem
from kvdiverge.pipeline.names import config_name_problem

__all__ = [
    "FIRST_GROUP",
    "ConfigError",
    "action_groups",
    "check_config",
    "check_generation_reserve",
    "check_references",
    "load_schema",
    "load_yaml_strict",
    "study_groups",
    "validate_config",
]


class ConfigError(ValueError):
    """The configuration is unusable; the message is one line naming the field or file."""


# ---- strict YAML --------------------------------------------------------------------------------
_PLAIN_INT = re.compile(r"[-+]?(0|[1-9][0-9_]*|0x[0-9a-fA-F_]+)")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and YAML 1.1's surprising implicit scalars."""


def _where(loader_name: str, node: yaml.Node) -> str:
    return f"{loader_name} line {node.start_mark.line + 1}"


def _strict_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *anchor` entries may be overridden by the mapping's own keys
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise ConfigError(
                f"{_where(loader.name, key_node)}: duplicate key {key!r} (first at line "
                f"{seen[key].start_mark.line + 1}); a YAML mapping takes each key once"
            )
        seen[key] = key_node
    return loader.construct_mapping(node, deep=True)


def _strict_bool(loader: _StrictLoader, node: yaml.ScalarNode) -> bool:
    if node.value.lower() not in ("true", "false"):
        raise ConfigError(
            f"{_where(loader.name, node)}: {node.value!r} is read as a boolean by YAML 1.1; "
            "write true or false, or quote it for a string"
        )
    return node.value.lower() == "true"


def _strict_int(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    value = yaml.SafeLoader.construct_yaml_int(loader, node)
    if not _PLAIN_INT.fullmatch(node.value):
        raise ConfigError(
            f"{_where(loader.name, node)}: {node.value!r} is read as the integer {value} by "
            "YAML 1.1; write a plain decimal, or quote it for a string"
        )
    return value


def _construct_map(loader: _StrictLoader, node: yaml.MappingNode):
    data: dict[Any, Any] = {}
    yield data
    data.update(_strict_mapping(loader, node))


_StrictLoader.add_constructor("tag:yaml.org,2002:map", _construct_map)
_StrictLoader.add_constructor("tag:yaml.org,2002:bool", _strict_bool)
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _strict_int)


def load_yaml_strict(path: str | os.PathLike) -> Any:
    """Read a YAML (or JSON) file strictly; :class:`ConfigError` naming the file and line.

    Refused: duplicate keys in a mapping, booleans other than ``true``/``false`` (YAML 1.1 reads
    ``yes``, ``no``, ``on``, ``off`` as booleans), integers other than plain decimals or ``0x``
    hex (YAML 1.1 reads ``010`` as 8 and ``1:30`` as 90), and text that is not YAML.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            loader = _StrictLoader(fh)
            loader.name = str(path)
            try:
                return loader.get_single_data()
            finally:
                loader.dispose()
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: file not found") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}{line}: not valid YAML ({problem})") from exc


def load_schema(path: str | os.PathLike) -> dict[str, Any]:
    """Read a JSON schema written in YAML (strictly, :func:`load_yaml_strict`)."""
    return load_yaml_strict(path)


# ---- schema validation --------------------------------------------------------------------------
def _extend_with_default(validator_class: type) -> type:
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    # strict kinds: an integer field takes neither 4.0 nor true (no silent coercion)
    checker = validator_class.TYPE_CHECKER.redefine(
        "integer", lambda _, x: isinstance(x, int) and not isinstance(x, bool)
    )
    return jsonschema.validators.extend(
        validator_class, {"properties": set_defaults}, type_checker=checker
    )


_DefaultFillingValidator = _extend_with_default(jsonschema.Draft202012Validator)


def _field(error: jsonschema.ValidationError) -> str:
    parts = ["config"]
    for p in error.absolute_path:
        parts.append(f"[{p}]" if isinstance(p, int) else f".{p}")
    return "".join(parts).replace(".[", "[")


def _describe(error: jsonschema.ValidationError) -> str:
    v, s = error.validator, error.validator_value
    got = repr(error.instance)
    if len(got) > 60:
        got = got[:57] + "..."
    if v == "type":
        return f"expected {s if isinstance(s, str) else ' or '.join(s)}, got {got}"
    if v == "minimum":
        return f"expected a value >= {s}, got {got}"
    if v == "exclusiveMinimum":
        return f"expected a value > {s}, got {got}"
    if v == "maximum":
        return f"expected a value <= {s}, got {got}"
    if v == "exclusiveMaximum":
        return f"expected a value < {s}, got {got}"
    if v == "enum":
        return f"expected one of {', '.join(map(repr, s))}, got {got}"
    if v == "additionalProperties":
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        return f"unknown key(s) {', '.join(map(repr, extra))}"
    if v in ("minItems", "maxItems", "minLength", "pattern", "uniqueItems"):
        return f"{error.message}"
    if v == "anyOf":
        return f"expected {' or '.join(_kind(option) for option in s)}, got {got}"
    return error.message


def _kind(schema: Mapping[str, Any]) -> str:
    """A value kind of a schema, in words (e.g. ``an integer >= 1``, ``'plan'``)."""
    if "const" in schema:
        return repr(schema["const"])
    kind = {"integer": "an integer", "number": "a number", "string": "a string"}.get(
        schema.get("type"), str(schema.get("type", "a value"))
    )
    return f"{kind} >= {schema['minimum']}" if "minimum" in schema else kind


def validate_config(config: dict[str, Any], schema: Mapping[str, Any] | str | os.PathLike) -> None:
    """Validate ``config`` in place against ``schema``, filling schema defaults.

    Raises :class:`ConfigError` with one line: ``config.<field>: <what was expected>``.
    """
    if not isinstance(schema, Mapping):
        schema = load_schema(schema)
    validator = _DefaultFillingValidator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: (len(e.absolute_path), e.path))
    if errors:
        err = errors[0]
        if err.validator == "required":
            missing = err.message.split("'")[1] if "'" in err.message else err.message
            msg = f"{_field(err)}: missing required key {missing!r}"
        else:
            msg = f"{_field(err)}: {_describe(err)}"
        raise ConfigError(msg.replace("\n", " "))


def check_generation_reserve(config: Mapping[str, Any]) -> None:
    """Every prompt must leave room for the horizon: ``datasets.generation_reserve`` ≥
    ``rollout.H`` (RULER's budget rule n + tokens_to_generate ≤ target length).

    Raises :class:`ConfigError` in one line otherwise. A larger reserve is allowed (shorter
    prompts than the stratum's length would admit).
    """
    reserve = config.get("datasets", {}).get("generation_reserve")
    horizon = config.get("rollout", {}).get("H")
    if reserve is not None and horizon is not None and reserve < horizon:
        raise ConfigError(
            f"config.datasets.generation_reserve: {reserve} leaves less room than the "
            f"rollout.H = {horizon} generated tokens; expected an integer >= {horizon}"
        )


# ---- cross-references ---------------------------------------------------------------------------
def _names(items: Iterable[str]) -> str:
    return ", ".join(items) or "none configured"


def _check_models(config: Mapping[str, Any]) -> None:
    """Each model has exactly one of ``path``, ``demo``, ``source``; a built one has no other
    path than data/models/<name>."""
    for name, spec in config.get("models", {}).items():
        where = f"config.models.{name}"
        if spec.get("demo") and spec.get("source"):
            raise ConfigError(f"{where}: expected `demo` or `source`, not both")
        if spec.get("demo") or spec.get("source"):
            path = f"data/models/{name}"
            if spec.get("path", path) != path:
                kind = "a demo model is built" if spec.get("demo") else "a sourced model is written"
                raise ConfigError(f"{where}.path: {kind} into {path}, got {spec['path']!r}")
        elif not spec.get("path"):
            raise ConfigError(f"{where}: expected `path` (directory or hub id), `demo` or `source`")
        if spec.get("train") is not None and not spec.get("demo"):
            raise ConfigError(f"{where}.train: only a `demo` model is trained; remove `train`")


def _parse_actions(config: Mapping[str, Any]) -> dict[str, Any]:
    from kvdiverge.eviction import ActionError, parse_action

    out = {}
    for name, spec in config.get("actions", {}).items():
        try:
            out[name] = parse_action(selector_entry(spec), name=name)  # no label
        except ActionError as exc:
            raise ConfigError(f"config.{exc}".replace("\n", " ")) from exc
    return out


def _check_groups(where: str, spec: Mapping[str, Any], control: str) -> None:
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


def _check_studies(config: Mapping[str, Any], actions: Mapping[str, Any]) -> None:
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
        _check_groups(where, spec, control)
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


def _compared(config: Mapping[str, Any], study: str) -> list[str]:
    spec = config["studies"][study]
    return [a for a in spec["actions"] if a != spec.get("control", "full")]


def _check_pair(config: Mapping[str, Any], where: str, study: str, pair: Any) -> None:
    compared = _compared(config, study)
    if len(pair) != 2 or pair[0] == pair[1] or any(a not in compared for a in pair):
        raise ConfigError(
            f"{where}: expected [b, a], two different non-control actions of the study "
            f"({', '.join(compared)}), got {list(pair)}"
        )


def study_contrasts(config: Mapping[str, Any], study: str) -> list[list[str]]:
    """The study's contrasts [b, a] (analysis.contrasts, else every pair of non-control
    actions, earlier minus later)."""
    compared = _compared(config, study)
    pairs = [[b, a] for i, b in enumerate(compared) for a in compared[i + 1 :]]
    given = config.get("analysis", {}).get("contrasts", {}).get(study)
    return [list(p) for p in (given or pairs)]


def _check_analysis_references(config: Mapping[str, Any]) -> None:
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


_CLOCK_FIELDS = {
    "branch_depth": "branch_depth",
    "window": "window",
    "prefix": "prefix",
    "agreement_run": "agreement_run",
    "blocks": "block_edges",
}


def _check_clock(config: Mapping[str, Any]) -> Any:
    """The analysis clock at ``rollout.H`` (every step count in range); returns it."""
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


def _check_family_estimands(config: Mapping[str, Any], clock: Any) -> None:
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


def _check_length_tokenizer(config: Mapping[str, Any]) -> None:
    if not config.get("studies"):
        return  # no documents are built
    name = config.get("datasets", {}).get("length_tokenizer")
    models = config.get("models", {})
    if name not in models:
        raise ConfigError(
            f"config.datasets.length_tokenizer: expected the name of a configured model "
            f"({_names(models)}), got {name!r}"
        )


def _check_budgets(config: Mapping[str, Any], actions: Mapping[str, Any]) -> None:
    """Every action a study runs, at every stratum's longest prompt (target_tokens −
    generation_reserve under the length tokenizer): it evicts something, keeps at least one
    entry, and leaves room for what its selector always keeps (window, sinks)."""
    from kvdiverge.eviction import ActionError

    datasets = config.get("datasets", {})
    reserve = datasets.get("generation_reserve", 128)
    used = dict.fromkeys(a for s in config.get("studies", {}).values() for a in s["actions"])
    for name in used:
        action = actions[name]
        if keeps_everything(action) or is_transform(action):  # no kept count to check
            continue
        for stratum in datasets.get("strata", []):
            label = f"{stratum['env']}-{stratum['label']}"
            n = stratum["target_tokens"] - reserve
            where = (
                f"config.actions.{name}: in stratum {label} (prompts of at most {n} tokens: "
                f"target_tokens {stratum['target_tokens']} - generation_reserve {reserve})"
            )
            if n < 1:
                continue  # DatasetsConfig names the stratum
            try:
                keep = action.n_keep(n)
                if keep >= n:
                    raise ConfigError(
                        f"{where}: budget {action.budget!r} keeps every entry, so the action "
                        "equals full retention there; lower the budget or lengthen the stratum"
                    )
                check_action(action, n, keep)
            except ActionError as exc:
                message = str(exc).split(": ", 1)[-1]
                raise ConfigError(f"{where}: {message}") from exc


def _check_swrb(config: Mapping[str, Any]) -> None:
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
    """Resolve every cross-reference of a validated config; :class:`ConfigError` in one line
    naming the field (module docstring lists the checks)."""
    check_generation_reserve(config)
    checks = (actions_problem, decoding_problem, baseline_problem, bootstrap_draws_problem)
    if problem := next(filter(None, (check(config) for check in checks)), None):
        raise ConfigError(problem)
    if problem := extremes_problem(config):
        raise ConfigError(problem)
    _check_finite_state(config)
    _check_models(config)
    actions = _parse_actions(config)
    _check_studies(config, actions)
    _check_swrb(config)
    _check_analysis_references(config)
    _check_length_tokenizer(config)
    clock = _check_clock(config)
    _check_family_estimands(config, clock)
    _check_budgets(config, actions)


def check_config(
    config: dict[str, Any],
    schema: Mapping[str, Any] | str | os.PathLike,
    files: Iterable[str | os.PathLike] = (),
) -> list[str]:
    """Every parse-time check of the run's configuration, in order: the YAML ``files`` it was
    read from, none a YTE template, read strictly (:func:`load_yaml_strict`); every name (models,
    actions, studies, rollout groups, strata: ``kvdiverge.pipeline.names``); the values against
    ``schema`` (:func:`validate_config`, which fills defaults in place); the cross-references
    (:func:`check_references`). Raises :class:`ConfigError` in one line. Returns the notes of
    :func:`kvdiverge.pipeline.decoding.greedy_replicates` (K = 1 at temperature 0, in place)."""
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
