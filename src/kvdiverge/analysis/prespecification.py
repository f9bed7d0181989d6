"""The prespecification lock: what a study fixes before any evaluation rollout runs (README
"Prespecification"; `docs/architecture.md`, "File contracts").

A study's lock (``results/{study}/lock.json``) is written from the config and the study's
sample-size plan (:mod:`kvdiverge.analysis.planning`, made from the development rollouts alone)
before the first evaluation rollout of the study starts. It records:

* ``design``: the models, the actions with every parameter, the control and its replicates,
  the evaluation cohort, the strata and documents per stratum, H, the seed and the coupling,
  the config's ``K`` setting (``"plan"`` or a pinned integer) and the resolved evaluation ``K``;
* ``endpoints``: for a study with a prespecified family (``family_endpoints`` > 1, study 2),
  the family's ``estimands`` and each endpoint (model, action, estimand) in ``family``, with the
  settings that define them — the family size m, α and the family level 1 − α/m, the analysis
  clock (every step count that defines an estimand), H through the design, and the bootstrap
  draws; ``None`` for an exploratory study, whose analysis may change without re-locking;
* ``plan``: the plan as written;
* ``hash``: the first 16 hex digits of the SHA-256 of the canonical JSON (sorted keys) of the
  other fields.

Every evaluation trajectory file carries the hash in its metadata key ``lock``. The estimands
step checks, before any work (:func:`check_lock`), that the lock the current config implies
(with the locked plan) is the lock on disk, and that every evaluation trajectory file was
rolled out under it; either failure is one line naming the changed field or the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from kvdiverge.io import atomic_write_text

__all__ = [
    "LOCK_FIELDS",
    "PrespecificationError",
    "check_lock",
    "evaluation_cohorts",
    "first_difference",
    "lock_hash",
    "make_lock",
    "prespecified",
    "read_lock",
    "write_lock",
]

LOCK_FIELDS = ("study", "design", "endpoints", "plan")
"""The hashed fields of a lock, besides ``hash`` itself."""

_RERUN = (
    "rerun the workflow to re-lock and roll out the evaluation cohort again "
    '(README, "Prespecification")'
)


class PrespecificationError(ValueError):
    """A lock is unreadable, or no longer matches the config or the trajectories; one line."""


def prespecified(
    config: Mapping[str, Any],
    study: str,
    strata: Sequence[str],
    actions: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """What the config fixes for ``study`` before its evaluation rollouts (module docstring):
    ``study``, ``design`` (with the config's ``K`` setting) and ``endpoints`` (or ``None``).

    ``config``: a validated config (defaults filled); ``strata``: the stratum names;
    ``actions``: every action's full spec by name (``ActionSpec.as_dict``).
    """
    spec = config["studies"][study]
    control = spec.get("control", "full")
    cohort = spec.get("cohort", study)
    analysis = config["analysis"]
    compared = [a for a in spec["actions"] if a != control]
    design = {
        "models": list(config["models"]),
        "actions": {name: dict(actions[name]) for name in spec["actions"]},
        "control": control,
        "K_control": spec["K_control"],
        "cohort": cohort,
        "strata": list(strata),
        "documents_per_stratum": config["datasets"]["cohorts"][cohort],
        "K": spec["K"],
        "H": config["rollout"]["H"],
        "seed": config["seed"],
        "coupling": config["rollout"]["coupling"],
    }
    m = spec.get("family_endpoints", 1)
    endpoints = None
    if m > 1:
        endpoints = {
            "family_size": m,
            "alpha": analysis["alpha"],
            "level": 1 - analysis["alpha"] / m,
            "estimands": list(analysis["family_estimands"]),
            "family": [
                {"model": model, "action": action, "estimand": estimand}
                for model in config["models"]
                for action in compared
                for estimand in analysis["family_estimands"]
            ],
            "clock": dict(analysis["clock"]),
            "bootstrap_draws": spec["bootstrap_draws"],
        }
    return {"study": study, "design": design, "endpoints": endpoints}


def lock_hash(lock: Mapping[str, Any]) -> str:
    """SHA-256 (first 16 hex digits) of the canonical JSON of the lock's :data:`LOCK_FIELDS`."""
    content = {k: lock[k] for k in LOCK_FIELDS}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def make_lock(spec: Mapping[str, Any], plan: Mapping[str, Any]) -> dict[str, Any]:
    """The lock of a :func:`prespecified` ``spec`` with its ``plan`` (module docstring).

    The design's ``K_setting`` is the config's ``K``; ``K`` is that integer when pinned, else
    the plan's ``K_planned``.
    """
    design = dict(spec["design"])
    setting = design.pop("K")
    if setting == "plan":
        if not isinstance(plan.get("K_planned"), int):
            raise PrespecificationError(
                "plan: no integer 'K_planned' to take the evaluation K from"
            )
        resolved = plan["K_planned"]
    elif isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        resolved = setting
    else:
        raise PrespecificationError(
            f"design.K: expected 'plan' or an integer >= 1, got {setting!r}"
        )
    lock = {
        "study": spec["study"],
        "design": {**design, "K_setting": setting, "K": resolved},
        "endpoints": spec["endpoints"],
        "plan": dict(plan),
    }
    # through JSON, so that a lock compares equal to the same lock read back from its file
    lock = json.loads(json.dumps(lock, allow_nan=False))
    return {**lock, "hash": lock_hash(lock)}


def write_lock(lock: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write a lock atomically as indented JSON."""
    atomic_write_text(path, json.dumps(lock, indent=2, sort_keys=True) + "\n")


def read_lock(path: str | os.PathLike) -> dict[str, Any]:
    """A lock read back and checked: every field present and the hash that of its content (a
    lock edited by hand is refused)."""
    try:
        lock = json.loads(open(path, encoding="utf-8").read())
    except (OSError, json.JSONDecodeError) as exc:
        reason = str(exc).splitlines()[0]
        raise PrespecificationError(f"{path}: not a readable lock ({reason})") from exc
    if not isinstance(lock, dict):
        raise PrespecificationError(f"{path}: not a lock (expected a JSON object)")
    missing = [k for k in (*LOCK_FIELDS, "hash") if k not in lock]
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


def first_difference(a: Any, b: Any, where: str = "") -> tuple[str, Any, Any] | None:
    """The first field (dotted path, in sorted key order) where ``a`` and ``b`` differ, with
    both values; ``None`` when equal."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            field = f"{where}.{key}" if where else str(key)
            if key not in a or key not in b:
                return field, a.get(key), b.get(key)
            found = first_difference(a[key], b[key], field)
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_difference(x, y, f"{where}[{i}]")
            if found:
                return found
        return None
    return None if a == b else (where, a, b)


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def check_lock(
    path: str | os.PathLike,
    spec: Mapping[str, Any],
    trajectories: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """Refuse, in one line, an analysis whose lock no longer holds; return the lock.

    ``path``: the study's lock; ``spec``: :func:`prespecified` of the current config;
    ``trajectories``: the metadata of every evaluation trajectory file, by path. Checks that the
    lock the config implies with the locked plan is the lock at ``path`` (else names the first
    changed field, locked and now), then that every file carries that lock's hash.
    """
    lock = read_lock(path)
    now = make_lock(spec, lock["plan"])
    if now["hash"] != lock["hash"]:
        changed = first_difference(
            {k: lock[k] for k in LOCK_FIELDS}, {k: now[k] for k in LOCK_FIELDS}
        )
        field, locked, current = changed if changed else ("hash", lock["hash"], now["hash"])
        raise PrespecificationError(
            f"{path}: the config no longer matches the lock ({field}: locked {_short(locked)}, "
            f"now {_short(current)}); {_RERUN}"
        )
    for file, meta in trajectories.items():
        carried = meta.get("lock")
        if carried != lock["hash"]:
            under = f"lock {carried}" if carried else "no lock"
            raise PrespecificationError(
                f"{file}: rolled out under {under}, but the study's lock {path} is "
                f"{lock['hash']}; {_RERUN}"
            )
    return lock
