"""Configuration: JSON-schema validation with defaults, one clear line per error.

Snakemake's own ``validate`` prints the whole schema on failure; a user editing ``config.yaml``
needs the field and what was expected, before any work starts.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

__all__ = [
    "ConfigError",
    "check_generation_reserve",
    "load_schema",
    "module_fingerprint",
    "validate_config",
]


class ConfigError(ValueError):
    """The configuration does not satisfy the schema; the message is one line."""


def load_schema(path: str | os.PathLike) -> dict[str, Any]:
    """Read a JSON schema written in YAML."""
    with open(path) as fh:
        return yaml.safe_load(fh)


def _extend_with_default(validator_class: type) -> type:
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


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
    return error.message


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
    ``rollout.H`` (SPEC §5; RULER's budget rule n + tokens_to_generate ≤ target length).

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


def module_fingerprint(*modules: str) -> str:
    """SHA-256 (first 16 hex digits) of the source of the named modules, without importing them.

    A rule passes this as a ``params:`` entry so that editing a package module it uses reruns
    exactly its jobs (Snakemake does not track imported modules itself; DESIGN §5).
    A package name covers every ``.py`` file below it.
    """
    digest = hashlib.sha256()
    for name in sorted(modules):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ConfigError(f"module_fingerprint: no module named {name!r}")
        origin = Path(spec.origin)
        files = sorted(origin.parent.rglob("*.py")) if origin.name == "__init__.py" else [origin]
        for f in files:
            digest.update(f.name.encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()[:16]
