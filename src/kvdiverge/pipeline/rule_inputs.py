"""Named inputs of a Snakemake job, read back by key.

A rule that takes one file per model, action or stratum names each input ``<prefix>/<key>``
(``keyed`` in ``workflow/rules/helpers/analysis.smk``), so that its script finds a file by what
it is, never by its position in a list (``docs/architecture.md``, "The rule graph").
"""

from __future__ import annotations

from typing import Any


def keyed_inputs(named: Any, prefix: str) -> dict[str, Any]:
    """The entries of a Snakemake named list (``snakemake.input``) named ``<prefix>/<key>``, as
    ``{key: path or paths}`` in the rule's order."""
    start = f"{prefix}/"
    return {name[len(start) :]: value for name, value in named.items() if name.startswith(start)}


def split_keys(entries: dict[str, Any], parts: int) -> dict[tuple[str, ...], Any]:
    """``entries`` with each key ``a/b/...`` split into a tuple of ``parts`` names; raises
    :class:`ValueError` naming the key when it has another number of parts."""
    out: dict[tuple[str, ...], Any] = {}
    for key, value in entries.items():
        names = tuple(key.split("/"))
        if len(names) != parts:
            raise ValueError(f"input key {key!r}: expected {parts} names joined by '/'")
        out[names] = value
    return out
