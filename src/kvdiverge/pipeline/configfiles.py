"""A config file is data: YTE templating is refused (docs/configuration.md, "Security").

Snakemake reads every config file through YTE (``yte.process_yaml``), which evaluates the Python
expressions of a file whose top level sets ``__use_yte__: true``. It does so while it starts,
before the Snakefile runs (``--configfile`` files are read when the command line is parsed,
``configfile:`` when the Snakefile reaches it), even for a dry run; so the workflow cannot stop
the evaluation, only refuse the run before any job starts (``kvdiverge.config.check_config``)
with one line naming the file. :func:`templated` tells a file that asks for templating, from
its top-level keys alone, without evaluating anything.
"""

from __future__ import annotations

import os

import yaml

__all__ = ["TEMPLATING_KEY", "TEMPLATING_REFUSED", "templated"]

TEMPLATING_KEY = "__use_yte__"
TEMPLATING_REFUSED = (
    f"{TEMPLATING_KEY}: YTE templating is refused; a config file holds values, not code "
    "(Snakemake has already evaluated its expressions while loading it; "
    'docs/configuration.md, "Security")'
)


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
