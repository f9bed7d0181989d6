"""The names a user gives to models, actions, studies, rollout groups and strata (one pattern),
and the display labels of actions (one rule).

A name becomes a folder or file name under ``output_dir`` (``results/{study}/{model}/
trajectories/{action}/{stratum}.parquet``, ``results/{study}/locks/{group}.json``), a part of a
Snakemake rule name and a value of a wildcard. So a name is one path component that stays
where it is put: it matches :data:`NAME_PATTERN` — a letter or digit, then letters, digits and
``_ . + = @ -`` — and holds no ``..`` (``smollm2+lora``, ``snapkv@0.5``, ``ruler-4k``,
``budget=0.25`` are names; ``a/b``, ``../x``, ``a..b``, ``.hidden``, ``{x}`` and ``a b`` are
not). :func:`name_problem` says what is wrong with one, :func:`config_name_problem` with the
first bad name of a configuration, in one line naming its key
(:func:`kvdiverge.config.check_config` checks it first, at parse time).

A display label (``actions.<name>.label``, and the ``LABEL`` of ``kvdiverge compare``'s
``LABEL=SPEC`` items) is free text, not a name: at most :data:`MAX_LABEL` printable characters,
not blank, and without ``" - "``, which separates the two actions of a contrast (``"b - a"``).
:func:`label_problem` states that one rule for both front ends, each adding its own field
(``config.actions.<name>.label``, ``--actions label``). Whether labels are unique is each front
end's own check: a config's labels stand beside the actions' names (a label may not repeat
another action's name), while compare's labels are the actions' names and name its files
(two labels may not differ only in case).

A wildcard constraint built from names (``model=…`` in ``workflow/rules/*.smk``) is a regular
expression: :func:`wildcard_alternation` escapes each name, so ``smollm2+lora`` matches itself
and nothing else.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "MAX_LABEL",
    "NAME_PATTERN",
    "NAME_RULE",
    "config_name_problem",
    "label_problem",
    "name_problem",
    "wildcard_alternation",
]

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.+=@-]*$"
NAME_RULE = (
    f"a name matching {NAME_PATTERN} without '..' (a letter or digit, then letters, digits "
    "and _ . + = @ -)"
)
_NAME = re.compile(NAME_PATTERN)
MAX_LABEL = 40
"""The longest display label (characters)."""
_LABEL = f"a non-empty string of at most {MAX_LABEL} printable characters"


def name_problem(name: object) -> str | None:
    """None for a valid name; else what was expected and what was given, for one message line."""
    if isinstance(name, str) and _NAME.fullmatch(name) and ".." not in name:
        return None
    return f"expected {NAME_RULE}, got {name!r}"


def label_problem(label: object) -> str | None:
    """None for a valid display label (module docstring); else what was expected and what was
    given, for one message line after the field's name: a string with a non-blank character,
    printable characters only, ``len(label) <= MAX_LABEL``, no ``" - "``."""
    if not isinstance(label, str) or not label.strip() or not label.isprintable():
        return f"expected {_LABEL}, got {label!r}"
    if len(label) > MAX_LABEL:
        return f"expected {_LABEL}, got {len(label)} characters ({label!r})"
    if " - " in label:
        return (
            "expected a label without ' - ' (it separates the two actions of a contrast), "
            f"got {label!r}"
        )
    return None


def wildcard_alternation(names: Iterable[str], none: str) -> str:
    """A Snakemake wildcard constraint matching exactly ``names``: each name regex-escaped,
    joined by ``|``; ``none`` (a placeholder no path holds) when there are no names."""
    escaped = [re.escape(name) for name in names]
    return "|".join(escaped) or re.escape(none)


def config_name_problem(config: Mapping[str, Any]) -> str | None:
    """The first bad name of a configuration, as one line ``config.<key>: expected …, got …``,
    or None: every model, action, study, rollout group and stratum label. Run before the
    schema check, so it passes over sections of the wrong kind (the schema names those)."""

    def entries(node: Any) -> Mapping[Any, Any]:
        return node if isinstance(node, Mapping) else {}

    for section in ("models", "actions", "studies"):
        for name in entries(config.get(section)):
            problem = name_problem(name)
            if problem:
                return f"config.{section}.{name}: {problem}"
    for study, spec in entries(config.get("studies")).items():
        for group in entries(entries(spec).get("groups")):
            problem = name_problem(group)
            if problem:
                return f"config.studies.{study}.groups.{group}: {problem}"
    strata = entries(config.get("datasets")).get("strata")
    for i, stratum in enumerate(strata if isinstance(strata, list) else []):
        label = entries(stratum).get("label")
        problem = name_problem(label) if isinstance(label, str) else None
        if problem:
            return f"config.datasets.strata[{i}].label: {problem}"
    return None
