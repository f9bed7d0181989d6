"""Reading a config file: strictly, and as data.

* :func:`load_yaml_strict`: every YAML file the run reads (config files, the schema) is read
  strictly: a duplicate key, a YAML 1.1 boolean spelled ``yes``/``no``/``on``/``off`` and an
  integer in a YAML 1.1 form (``010``, ``1:30``) are errors, never silent coercions.
* :func:`templated`: YTE templating is refused (``docs/configuration.md``, "Security").
  Snakemake reads every config file through YTE (``yte.process_yaml``), which evaluates the
  Python expressions of a file whose top level sets ``__use_yte__: true``. It does so while it
  starts, before the Snakefile runs (``--configfile`` files are read when the command line is
  parsed, ``configfile:`` when the Snakefile reaches it), even for a dry run; so the workflow
  cannot stop the evaluation, only refuse the run before any job starts
  (:func:`kvdiverge.config.check_config`) with one line naming the file
  (:data:`TEMPLATING_REFUSED`). :func:`templated` tells a file that asks for templating from
  its top-level keys alone, without evaluating anything.
"""

from __future__ import annotations

import os
import re
from typing import Any

import yaml

from kvdiverge.config.errors import ConfigError

__all__ = [
    "TEMPLATING_KEY",
    "TEMPLATING_REFUSED",
    "load_schema",
    "load_yaml_strict",
    "templated",
]

TEMPLATING_KEY = "__use_yte__"
TEMPLATING_REFUSED = (
    f"{TEMPLATING_KEY}: YTE templating is refused; a config file holds values, not code "
    "(Snakemake has already evaluated its expressions while loading it; "
    'docs/configuration.md, "Security")'
)

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


def templated(path: str | os.PathLike) -> bool:
    """Whether the YAML file at ``path`` has a top-level ``__use_yte__`` key (whatever its
    value). Only composed, never constructed or evaluated; a file that is not YAML is left to
    the strict reader (False)."""
    try:
        with open(path, encoding="utf-8") as fh:
            node = yaml.compose(fh, Loader=yaml.SafeLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    if not isinstance(node, yaml.MappingNode):
        return False
    return any(getattr(key, "value", None) == TEMPLATING_KEY for key, _ in node.value)
