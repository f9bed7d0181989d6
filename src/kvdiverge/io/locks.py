"""Lock files (``docs/prespecification.md``, "Prespecification"): a study's registered design and
endpoints, hashed, written before any evaluation rollout and read back checked by every job
that relies on them. What goes into a lock is :mod:`kvdiverge.analysis.prespecification`'s; this
module only reads and writes the file, so a rollout job reaches no analysis code."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from kvdiverge.io.files import atomic_write_text

__all__ = [
    "AMENDMENT_FIELDS",
    "LOCK_FIELDS",
    "PrespecificationError",
    "check_evaluation_documents",
    "evaluation_cohorts",
    "evaluation_documents_digest",
    "evaluation_seed",
    "lock_hash",
    "read_lock",
    "write_lock",
]

LOCK_FIELDS = ("study", "design", "endpoints", "plan")
"""The hashed fields of a lock, besides ``hash`` itself."""

AMENDMENT_FIELDS = ("study", "group", "study_lock", "design", "endpoints")
"""The hashed fields of a later group's amendment, besides ``hash`` itself."""

_RERUN = (
    "rerun the workflow to re-lock and roll out the evaluation cohort again "
    '(docs/prespecification.md, "Prespecification")'
)


class PrespecificationError(ValueError):
    """A lock is unreadable, or no longer matches the config or the trajectories; one line."""


def lock_hash(lock: Mapping[str, Any]) -> str:
    """SHA-256 (first 16 hex digits) of the canonical JSON of the lock's :data:`LOCK_FIELDS`
    (an amendment's :data:`AMENDMENT_FIELDS`: a lock with a ``group``)."""
    fields = AMENDMENT_FIELDS if "group" in lock else LOCK_FIELDS
    content = {k: lock[k] for k in fields}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_lock(lock: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write a lock (or an amendment) atomically as indented JSON."""
    atomic_write_text(path, json.dumps(lock, indent=2, sort_keys=True) + "\n")


def read_lock(path: str | os.PathLike) -> dict[str, Any]:
    """A lock (or an amendment: a lock with a ``group``) read back and checked: every field
    present and the hash that of its content (a lock edited by hand is refused)."""
    try:
        lock = json.loads(open(path, encoding="utf-8").read())
    except (OSError, json.JSONDecodeError) as exc:
        reason = str(exc).splitlines()[0]
        raise PrespecificationError(f"{path}: not a readable lock ({reason})") from exc
    if not isinstance(lock, dict):
        raise PrespecificationError(f"{path}: not a lock (expected a JSON object)")
    fields = AMENDMENT_FIELDS if "group" in lock else LOCK_FIELDS
    missing = [k for k in (*fields, "hash") if k not in lock]
    if missing:
        raise PrespecificationError(f"{path}: lock lacks field(s) {', '.join(missing)}")
    if lock_hash(lock) != lock["hash"]:
        raise PrespecificationError(
            f"{path}: the lock's content does not match its hash {lock['hash']} (edited by "
            f"hand?); {_RERUN}"
        )
    design = lock["design"]
    for key in ("actions", "control", "cohort", "K", "K_control"):
        if key not in design:
            raise PrespecificationError(f"{path}: lock lacks design.{key}")
    return lock


def evaluation_cohorts(lock: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Replicates per evaluation cohort of each action of a lock's design: the control
    K_control, every other action the locked K."""
    design = lock["design"]
    return {
        name: {design["cohort"]: design["K_control"] if name == design["control"] else design["K"]}
        for name in design["actions"]
    }


def evaluation_seed(lock: Mapping[str, Any]) -> int:
    """The seed of a lock's evaluation rollouts: a 63-bit key of its registration's hash (an
    amendment's: its study lock's, so a later group's reference stream X is the first
    group's). Any change to what is registered gives new evaluation trajectories; the
    development rollouts, before any lock, keep the config's seed."""
    from kvdiverge.theory.coupling import document_key  # here: the workflow's parse loads no numpy

    registered = lock["study_lock"] if "group" in lock else lock["hash"]
    return document_key(f"evaluation\x1f{registered}")


_DIGESTED = ("task", "prompt", "answers")


def evaluation_documents_digest(paths: Sequence[str | os.PathLike], cohort: str) -> dict[str, str]:
    """Per stratum, the first 16 hex digits of the SHA-256 of the evaluation cohort's
    documents (``doc_id``, ``task``, ``prompt``, ``answers``, in ``doc_id`` order) in the
    documents files ``paths``: what a lock registers as the documents it will be evaluated
    on."""
    from kvdiverge.io.documents import read_documents  # here: the workflow's parse loads no polars

    rows: dict[str, list] = {}
    for path in paths:
        frame = read_documents(path, columns=["stratum", "cohort", *_DIGESTED])
        frame = frame.filter(frame["cohort"] == cohort).sort("doc_id")
        for row in frame.iter_rows(named=True):
            rows.setdefault(row["stratum"], []).append(
                [row["doc_id"], *(row[k] for k in _DIGESTED)]
            )
    return {
        stratum: hashlib.sha256(
            json.dumps(content, separators=(",", ":"), ensure_ascii=False).encode()
        ).hexdigest()[:16]
        for stratum, content in sorted(rows.items())
    }


def check_evaluation_documents(
    lock: Mapping[str, Any], lock_path: str | os.PathLike, documents: str | os.PathLike
) -> None:
    """Refuse, in one line, an evaluation rollout of documents other than those its lock
    registered (``design.documents``, :func:`evaluation_documents_digest`); a lock without
    digests (an amendment) passes."""
    registered = lock["design"].get("documents")
    if not registered:
        return
    found = evaluation_documents_digest([documents], lock["design"]["cohort"])
    for stratum, digest in found.items():
        if registered.get(stratum) != digest:
            raise PrespecificationError(
                f"{documents}: the {lock['design']['cohort']} documents of stratum {stratum} "
                f"are not those registered in {lock_path} (digest {digest}, registered "
                f"{registered.get(stratum) or 'none'}); {_RERUN}"
            )
