"""The values of a configuration against its JSON schema (``workflow/schemas/
config.schema.yaml``): kinds and ranges of every value, schema defaults filled in place.

Snakemake's own ``validate`` prints the whole schema on failure; a user editing
``config.yaml`` needs the field and what was expected. :func:`validate_config` raises
:class:`~kvdiverge.config.errors.ConfigError` with one line ``config.<field>: <what was
expected>``. Kinds are strict: an integer field takes neither ``4.0`` nor ``true``. A schema
node's ``$comment`` is the reason for its rule, appended to the line in parentheses (so the
schema says why, e.g., ``K_dev`` must be at least 2 away from greedy decoding).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

import jsonschema

from kvdiverge.config.errors import ConfigError
from kvdiverge.config.reading import load_schema

__all__ = ["validate_config"]


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

    Raises :class:`~kvdiverge.config.errors.ConfigError` with one line: ``config.<field>: <what
    was expected>`` (and the failing rule's ``$comment`` in parentheses, where it has one).
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
        reason = err.schema.get("$comment") if isinstance(err.schema, Mapping) else None
        if reason:
            msg += f" ({' '.join(str(reason).split())})"
        raise ConfigError(msg.replace("\n", " "))
