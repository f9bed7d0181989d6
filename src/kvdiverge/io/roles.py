"""A stored file's role against where it is read: each trajectory or SWRB record file names its
own model, action (and, where written, study), and holds documents ``{stratum}/{cohort}/...``;
a reader that expects a file of action ``a`` of model ``m`` (its path says so) refuses one whose
metadata says otherwise, in one line naming the file, the field, both values and what to do (two
actions' files swapped under each other's names, or a file copied from another model's run,
stop there instead of being analysed as what their names say).

Token ids: every token of a file lies in [0, vocab_size) of the model that wrote it (the
metadata's ``vocab_size``, the rows of its output layer, where the file records it; ids below 0
are refused in any file).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["ROLE_KEYS", "recorded_role", "role_problem", "token_ids_problem"]

ROLE_KEYS = ("study", "model", "action", "stratum", "cohort")
"""The roles a reader may expect of a file."""


def _name(value: Any) -> Any:
    """A role's name from its metadata entry: a mapping's ``name`` (model, action), else the
    value itself."""
    return value.get("name") if isinstance(value, Mapping) else value


def recorded_role(metadata: Mapping[str, Any], doc_ids: Iterable[str] = ()) -> dict[str, Any]:
    """What a file says it is: ``study``, ``model`` and ``action`` from its metadata (those it
    records), ``stratum`` and ``cohort`` as the sets of its doc_ids' first two parts."""
    out = {key: _name(metadata[key]) for key in ("study", "model", "action") if key in metadata}
    parts = [str(d).split("/") for d in doc_ids]
    out["stratum"] = {p[0] for p in parts if len(p) >= 3}
    out["cohort"] = {p[-2] for p in parts if len(p) >= 3}
    return out


def role_problem(
    path: str | os.PathLike,
    metadata: Mapping[str, Any],
    expected: Mapping[str, Any],
    doc_ids: Iterable[str] = (),
    what: str = "file",
) -> str | None:
    """The one line refusing a file read as ``expected`` (role → name; ``cohort``: a name or a
    collection of allowed names) whose metadata or documents say another, or None. A role the
    file does not record is not checked."""
    unknown = sorted(set(expected) - set(ROLE_KEYS))
    if unknown:
        raise ValueError(f"role {unknown[0]!r}: expected one of {', '.join(ROLE_KEYS)}")
    recorded = recorded_role(metadata, doc_ids)
    for key in ("study", "model", "action"):
        want = expected.get(key)
        if want is None or key not in recorded or recorded[key] is None:
            continue
        if str(recorded[key]) != str(want):
            return (
                f"{path}: its metadata says {key} {recorded[key]!r}, but it is read as the "
                f"{what} of {key} {want!r}; expected the file written for {key} {want!r} "
                "(files swapped or copied under another name: rerun that job)"
            )
    for key in ("stratum", "cohort"):
        want = expected.get(key)
        if want is None:
            continue
        allowed = {want} if isinstance(want, str) else set(want)
        stray = sorted(recorded[key] - allowed)
        if stray:
            shown = ", ".join(sorted(allowed))
            return (
                f"{path}: holds documents of {key} {stray[0]!r}, but it is read as the {what} "
                f"of {key} {shown}; expected only its documents (files swapped or copied under "
                "another name: rerun that job)"
            )
    return None


def token_ids_problem(
    path: str | os.PathLike, column: str, lowest: int, highest: int, vocab_size: Any
) -> str | None:
    """The one line refusing a token column whose ids span [lowest, highest] when they must lie
    in [0, vocab_size) (``vocab_size`` None: only ids below 0 are refused), or None."""
    if lowest < 0:
        return f"{path}: {column} holds token id {lowest}; expected token ids >= 0"
    ok = isinstance(vocab_size, int) and not isinstance(vocab_size, bool)
    if ok and highest >= vocab_size:
        return (
            f"{path}: {column} holds token id {highest}; expected token ids below the model's "
            f"vocab_size {vocab_size} (the file's metadata)"
        )
    return None
