"""The prespecification lock: what a study fixes before any evaluation rollout runs
(`docs/prespecification.md`, "Prespecification"; `docs/architecture.md`, "File contracts").

A study's lock (``results/{study}/lock.json``) is written from the config and the study's
sample-size plan (:mod:`kvdiverge.analysis.planning`, made from the development rollouts alone)
before the first evaluation rollout of the study starts. It records:

* ``design``: the models, the actions with every parameter, the control and its replicates,
  the evaluation cohort, the strata and documents per stratum, H, the seed, the coupling and
  the decoding temperature (``rollout.temperature``; 0: greedy), the config's ``K`` setting
  (``"plan"`` or a pinned integer) and the resolved evaluation ``K``;
* ``endpoints``: for a study with a prespecified family (``family_endpoints`` > 1, study 2),
  the family's ``estimands`` and each endpoint (model, action, estimand) in ``family``, with the
  settings that define them — the family size m, α and the family level 1 − α/m, the analysis
  clock (every step count that defines an estimand), H through the design, and the bootstrap
  draws; ``None`` for an exploratory study, whose analysis may change without re-locking;
* ``plan``: the plan as written;
* ``hash``: the first 16 hex digits of the SHA-256 of the canonical JSON (sorted keys) of the
  other fields.

A study whose actions are split into rollout groups (``studies.<study>.groups``,
:func:`kvdiverge.analysis.groups.study_groups`) plans K from the FIRST group's development rollouts
alone, and its lock covers the first group: ``design.actions`` are that group's actions and
``endpoints.family`` the endpoints among them (with one group, the default, that is every
action). Each later group gets an amendment (``results/{study}/locks/{group}.json``,
:func:`make_amendment`), written before its evaluation rollouts, with the fields:

* ``study``, ``group``, and ``study_lock``: the study lock's hash;
* ``design``: the group's actions with every parameter, the control and ``K_control``, the
  cohort, and the study lock's ``K_setting`` and resolved ``K`` (so K is never re-planned for
  a later group);
* ``endpoints``: for a study with a family, the family entries of the group's actions, with
  the same settings as the study lock's (``None`` for an exploratory study);
* ``hash``: as for a lock, over the other fields.

An endpoint belongs to the latest group, in config order, among the groups of its actions (a
family endpoint names one action, so it belongs to that action's group): appending a group
never changes the study lock or an earlier amendment, within the family size ``m`` that the
config fixes beforehand (at least the number of endpoints, checked at parse time).

Every evaluation trajectory file carries the hash of its group's lock (the study lock for the
first group, the amendment otherwise) in its metadata key ``lock``. The estimands step checks,
before any work (:func:`check_lock`), that the lock and every amendment the current config
implies (with the locked plan) are those on disk, and that every evaluation trajectory file was
rolled out under its group's; either failure is one line naming the changed field or the file.

What binds the evaluation (``docs/prespecification.md``, "Fixed by the lock"): the lock records
``design.documents``, a digest of each stratum's evaluation documents
(:func:`kvdiverge.io.locks.evaluation_documents_digest`, checked by every evaluation rollout
job), and ``endpoints.code``, the fingerprint of the code that computes the endpoints
(:func:`endpoint_fingerprint`, checked by the estimands step); the evaluation rollouts take
their seed from the lock's hash (:func:`kvdiverge.io.locks.evaluation_seed`). Every
registration is appended to ``lock_history.jsonl`` beside the lock (:func:`register`,
:func:`read_history`), and the lock carries its ``registration`` (number, earlier
registrations, time, reason) outside the hash; :func:`registration_line` says it in one line
for the tables and the report.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvdiverge.analysis.groups import study_groups
from kvdiverge.io.files import atomic_write_text
from kvdiverge.io.locks import (
    _RERUN,
    AMENDMENT_FIELDS,
    HISTORY_NAME,
    LOCK_FIELDS,
    ROLLOUT_SETTINGS,
    PrespecificationError,
    check_chain,
    check_history,
    check_trajectory,
    evaluation_cohorts,
    history_locked,
    history_path,
    lock_hash,
    read_history,
    read_lock,
    redo,
    write_lock,
)
from kvdiverge.pipeline.provenance import code_text, script_fingerprint

__all__ = [
    "AMENDMENT_FIELDS",
    "HISTORY_NAME",
    "LOCK_FIELDS",
    "PrespecificationError",
    "check_history",
    "check_lock",
    "endpoint_fingerprint",
    "evaluation_cohorts",
    "first_difference",
    "history_path",
    "lock_hash",
    "make_amendment",
    "make_lock",
    "prespecified",
    "prespecified_group",
    "read_history",
    "read_lock",
    "register",
    "registration_line",
    "rollout_models",
    "write_lock",
]


def rollout_models(
    development: Mapping[str, Mapping[str, Mapping[str, Any]]],
    digests: Mapping[str, Mapping[str, str] | None],
) -> dict[str, dict[str, Any]]:
    """The lock's ``rollout.models``: per model its ``weights`` and ``tokenizer`` digests
    (``digests``, :func:`kvdiverge.io.model_digest.model_digests` of its folder now) and the
    ``device`` (its type: ``cpu``, ``cuda``), ``dtype``, ``kernel`` (each attention layout's
    kernel, over all its files) and ``libraries`` its development rollouts recorded.

    ``development[model]``: the metadata of the model's development trajectory files by path.
    One line naming the file and field where two of a model's files disagree, a file lacks a
    field, a layout ran two kernels, or a file's recorded model digest is not the folder's now
    (the model changed after its development rollouts)."""
    out: dict[str, dict[str, Any]] = {}
    for model, files in development.items():
        entry: dict[str, Any] = {**(digests.get(model) or {"weights": None, "tokenizer": None})}
        kernel: dict[str, str] = {}
        first: dict[str, tuple[str, Any]] = {}
        for file, meta in files.items():
            recorded = meta.get("model_digest")
            if recorded != digests.get(model):
                raise PrespecificationError(
                    f"{file}: rolled out with model digest {_short(recorded)}, but the folder "
                    f"of {model} now has {_short(digests.get(model))} (changed after its "
                    f"development rollouts?); delete {file} and rerun the workflow"
                )
            device = meta.get("device")
            values = {
                "device": device.split(":")[0] if isinstance(device, str) else device,
                "dtype": meta.get("dtype"),
                "libraries": meta.get("libraries"),
            }
            for field, value in values.items():
                if value is None:
                    raise PrespecificationError(
                        f"{file}: trajectory metadata lacks {field!r} (written by an earlier "
                        f"version?); delete {file} and rerun the workflow"
                    )
                seen = first.setdefault(field, (file, value))
                if seen[1] != value:
                    raise PrespecificationError(
                        f"{file}: its development rollout ran {field} {_short(value)}, "
                        f"{seen[0]} ran {_short(seen[1])}: one model's rollouts must run alike"
                    )
            for layout, name in (meta.get("kernel") or {}).items():
                if kernel.setdefault(layout, name) != name:
                    raise PrespecificationError(
                        f"{file}: layout {layout} ran kernel {name!r}, another development "
                        f"file of {model} ran {kernel[layout]!r}: one model's rollouts must run "
                        f"alike"
                    )
        entry.update({k: v for k, (_, v) in first.items()}, kernel=dict(sorted(kernel.items())))
        out[model] = entry
    return out


def _endpoints(config: Mapping[str, Any], study: str, compared: Sequence[str]) -> Any:
    """The family endpoints of the non-control actions ``compared`` with their settings, or
    ``None`` for an exploratory study (``family_endpoints`` = 1)."""
    spec = config["studies"][study]
    analysis = config["analysis"]
    m = spec.get("family_endpoints", 1)
    if m <= 1:
        return None
    return {
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


def prespecified(
    config: Mapping[str, Any],
    study: str,
    strata: Sequence[str],
    actions: Mapping[str, Mapping[str, Any]],
    rollout_code: str | None = None,
) -> dict[str, Any]:
    """What the config fixes for ``study`` before its evaluation rollouts (module docstring):
    ``study``, ``design`` (with the config's ``K`` setting), ``endpoints`` (or ``None``), of
    the study's first rollout group (every action, without ``groups``), and ``rollout``: the
    code fingerprint of its evaluation rollout jobs and ``rollout.max_batch_rows``.

    ``config``: a validated config (defaults filled); ``strata``: the stratum names;
    ``actions``: every action's full spec by name (``ActionSpec.as_dict``); ``rollout_code``:
    the evaluation rollout rule's ``code`` param (``workflow/rules/helpers/rollouts.smk``).
    """
    spec = config["studies"][study]
    control = spec.get("control", "full")
    cohort = spec.get("cohort", study)
    first = next(iter(study_groups(config, study).values()))
    design = {
        "models": list(config["models"]),
        "actions": {name: dict(actions[name]) for name in first},
        "control": control,
        "K_control": spec["K_control"],
        "cohort": cohort,
        "strata": list(strata),
        "documents_per_stratum": config["datasets"]["cohorts"][cohort],
        "K": spec["K"],
        "H": config["rollout"]["H"],
        "seed": config["seed"],
        "coupling": config["rollout"]["coupling"],
        "temperature": config["rollout"].get("temperature", 1),
    }
    endpoints = _endpoints(config, study, [a for a in first if a != control])
    rollout = {"code": rollout_code, "max_batch_rows": config["rollout"]["max_batch_rows"]}
    return {"study": study, "design": design, "endpoints": endpoints, "rollout": rollout}


def prespecified_group(
    config: Mapping[str, Any],
    study: str,
    group: str,
    actions: Mapping[str, Mapping[str, Any]],
    rollout_code: str | None = None,
) -> dict[str, Any]:
    """What the config fixes for a later rollout ``group`` of ``study`` (not the first, whose
    content is :func:`prespecified`): ``study``, ``group``, ``design`` (the group's actions,
    the control, ``K_control`` and the cohort) and the ``endpoints`` of its actions (or
    ``None``), and ``rollout.code``, the group's evaluation rollout code fingerprint;
    :func:`make_amendment` adds the study lock's hash, K and rollout side.

    ``actions``: every action's full spec by name (``ActionSpec.as_dict``).
    """
    groups = study_groups(config, study)
    if group not in groups or group == next(iter(groups)):
        later = [g for g in groups if g != next(iter(groups))]
        raise PrespecificationError(
            f"config.studies.{study}.groups: no later rollout group {group!r} (later groups: "
            f"{', '.join(later) or 'none'}); the first group's lock is the study's"
        )
    spec = config["studies"][study]
    control = spec.get("control", "full")
    design = {
        "actions": {name: dict(actions[name]) for name in groups[group]},
        "control": control,
        "K_control": spec["K_control"],
        "cohort": spec.get("cohort", study),
    }
    endpoints = _endpoints(config, study, [a for a in groups[group] if a != control])
    return {
        "study": study,
        "group": group,
        "design": design,
        "endpoints": endpoints,
        "rollout": {"code": rollout_code},
    }


def make_lock(
    spec: Mapping[str, Any],
    plan: Mapping[str, Any],
    documents: Mapping[str, str] | None = None,
    endpoint_code: str | None = None,
    models: Mapping[str, Mapping[str, Any]] | None = None,
    chain: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The lock of a :func:`prespecified` ``spec`` with its ``plan`` (module docstring).

    The design's ``K_setting`` is the config's ``K``; ``K`` is that integer when pinned, else
    the plan's ``K_planned``. ``documents``: the evaluation documents' digest per stratum
    (:func:`kvdiverge.io.locks.evaluation_documents_digest`), recorded as ``design.documents``;
    ``endpoint_code``: the fingerprint of the code that computes the endpoints, recorded as
    ``endpoints.code`` (a study with endpoints). The plan's ``measured`` seconds (different on
    every machine) stay out of the lock.

    ``rollout`` (the rollout side, :mod:`kvdiverge.io.locks`): ``settings`` from the design
    and the spec's ``rollout.max_batch_rows``, ``code`` the spec's ``rollout.code`` (the
    evaluation rollout jobs' fingerprint), and ``models``: per model its digests and the
    device, dtype, kernel and libraries of its development rollouts (:func:`rollout_models`);
    ``None`` without ``models`` (a lock no evaluation rollout can run under). ``chain``: the
    registration's number and the previous registration's hash (:func:`register` sets it).
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
    if documents is not None:
        design["documents"] = dict(documents)
    endpoints = spec["endpoints"]
    if endpoints is not None and endpoint_code is not None:
        endpoints = {**endpoints, "code": endpoint_code}
    rollout_spec = spec.get("rollout") or {}
    rollout = None
    if models is not None:
        settings = {k: design.get(k) for k in ROLLOUT_SETTINGS if k != "max_batch_rows"}
        settings["max_batch_rows"] = rollout_spec.get("max_batch_rows")
        rollout = {"settings": settings, "code": rollout_spec.get("code"), "models": models}
    lock = {
        "study": spec["study"],
        "design": {**design, "K_setting": setting, "K": resolved},
        "endpoints": endpoints,
        "plan": {k: v for k, v in plan.items() if k != "measured"},
        "rollout": rollout,
        "chain": dict(chain) if chain is not None else None,
    }
    # through JSON, so that a lock compares equal to the same lock read back from its file
    lock = json.loads(json.dumps(lock, allow_nan=False))
    return {**lock, "hash": lock_hash(lock)}


def make_amendment(spec: Mapping[str, Any], study_lock: Mapping[str, Any]) -> dict[str, Any]:
    """The amendment of a later group: its :func:`prespecified_group` ``spec`` with the study
    lock's hash and resolved K (module docstring)."""
    if spec["study"] != study_lock["study"]:
        raise PrespecificationError(
            f"group {spec['group']!r} of study {spec['study']!r}: the study lock given is "
            f"study {study_lock['study']!r}'s"
        )
    design = dict(spec["design"])
    rollout_spec = spec.get("rollout") or {}
    registered = study_lock.get("rollout")
    rollout = (
        {**registered, "code": rollout_spec.get("code", registered.get("code"))}
        if registered
        else None
    )
    lock = {
        "study": spec["study"],
        "group": spec["group"],
        "study_lock": study_lock["hash"],
        "design": {
            **design,
            "K_setting": study_lock["design"]["K_setting"],
            "K": study_lock["design"]["K"],
        },
        "endpoints": spec["endpoints"],
        "rollout": rollout,
    }
    lock = json.loads(json.dumps(lock, allow_nan=False))
    return {**lock, "hash": lock_hash(lock)}


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


def _check_unchanged(
    path: str | os.PathLike, lock: Mapping[str, Any], now: Mapping[str, Any], fields: Sequence[str]
) -> None:
    if now["hash"] != lock["hash"]:
        changed = first_difference({k: lock[k] for k in fields}, {k: now[k] for k in fields})
        field, locked, current = changed if changed else ("hash", lock["hash"], now["hash"])
        raise PrespecificationError(
            f"{path}: the config no longer matches the lock ({field}: locked {_short(locked)}, "
            f"now {_short(current)}); {_RERUN}"
        )


def check_lock(
    path: str | os.PathLike,
    spec: Mapping[str, Any],
    trajectories: Mapping[str, Mapping[str, Any]],
    amendments: Mapping[str, tuple[str | os.PathLike, Mapping[str, Any]]] | None = None,
    endpoint_code: str | None = None,
) -> dict[str, Any]:
    """Refuse, in one line, an analysis whose lock no longer holds; return the lock.

    ``endpoint_code``: the fingerprint of the code computing the endpoints now (the estimands
    script's, :func:`kvdiverge.pipeline.provenance.script_fingerprint`); it must equal the one
    the lock registered (``endpoints.code``), else one line.

    ``path``: the study's lock; ``spec``: :func:`prespecified` of the current config;
    ``trajectories``: the metadata of every evaluation trajectory file, by path;
    ``amendments``: per later rollout group, the path of its amendment and its
    :func:`prespecified_group` of the current config. Checks that the lock is its history's
    last registration (:func:`kvdiverge.io.locks.check_history`), that the lock the config
    implies with the locked plan and rollout measurements is the lock at ``path`` and each
    amendment the one the config implies with that lock (else names the first changed field,
    locked and now), then that every file carries its group's hash (the group found from the
    action named in the file's metadata) and records the settings, model digests, code,
    kernel, device, dtype and libraries its lock registered
    (:func:`kvdiverge.io.locks.check_trajectory`).
    """
    lock = read_lock(path)
    check_history(lock, path)
    code = (lock["endpoints"] or {}).get("code")
    models = (lock["rollout"] or {}).get("models") if lock["rollout"] else None
    now = make_lock(
        spec, lock["plan"], lock["design"].get("documents"), code, models, lock["chain"]
    )
    _check_unchanged(path, lock, now, LOCK_FIELDS)
    if code is not None and endpoint_code is not None and endpoint_code != code:
        raise PrespecificationError(
            f"{path}: the code that computes the locked endpoints changed after registration "
            f"(fingerprint {endpoint_code}, registered {code}); restore it, or register anew: "
            f"delete {path} and rerun the workflow (docs/prespecification.md)"
        )
    under = {name: (path, lock) for name in lock["design"]["actions"]}
    for group_path, group_spec in (amendments or {}).values():
        amendment = read_lock(group_path)
        if "group" not in amendment:
            raise PrespecificationError(
                f"{group_path}: not an amendment of group {group_spec['group']!r} (no group)"
            )
        now = make_amendment(group_spec, lock)
        _check_unchanged(group_path, amendment, now, AMENDMENT_FIELDS)
        under.update({name: (group_path, amendment) for name in now["design"]["actions"]})
    for file, meta in trajectories.items():
        carried = meta.get("lock")
        action = (meta.get("action") or {}).get("name")
        lock_path, group_lock = under.get(action, (path, lock))
        if carried != group_lock["hash"]:
            carrier = f"lock {carried}" if carried else "no lock"
            raise PrespecificationError(
                f"{file}: rolled out under {carrier}, but its lock {lock_path} is "
                f"{group_lock['hash']}; {redo(file)}"
            )
        check_trajectory(file, meta, group_lock, lock_path)
    return lock


_CONTENT = tuple(k for k in LOCK_FIELDS if k != "chain")
_CAUSES = ("rollout", "design", "endpoints", "study", "plan")  # what a change is named by


def _reason(previous: Mapping[str, Any] | None, lock: Mapping[str, Any]) -> str:
    """The first field that changed since ``previous``, looked for in the order of
    :data:`_CAUSES`: a change of the rollouts or the design, not the plan it re-made."""
    if previous is None:
        return "first registration"
    for key in _CAUSES:
        changed = first_difference({key: previous.get(key)}, {key: lock[key]})
        if changed is not None:
            field, was, now = changed
            return f"{field} changed (was {_short(was)}, now {_short(now)})"
    return "registered again"


def register(
    lock: Mapping[str, Any],
    lock_path: str | os.PathLike,
    reason: str | None = None,
    time: datetime | None = None,
    evaluation_files: Sequence[str | os.PathLike] = (),
) -> dict[str, Any]:
    """Register ``lock``'s content (a :func:`make_lock`; its ``chain`` is set here) in the
    history beside ``lock_path`` and write the lock there; return it with its
    ``registration``: ``number`` (1 for the first), ``earlier`` (registrations before it),
    ``time`` (UTC), ``reason`` (by default the first field that changed since the previous
    registration) and ``history`` (the file).

    Under the history's OS file lock (:func:`kvdiverge.io.locks.history_locked`), so that
    concurrent writers keep every entry: the history is read and its chain checked
    (:func:`kvdiverge.io.locks.check_chain`); content equal to the last registration's is that
    registration again (its lock, hash and evaluation seed: nothing is appended); other
    content is appended as the next registration, its hashed ``chain`` naming its number and
    the previous registration's hash (append-only: the earlier lines are kept as they are). A
    first registration while any of ``evaluation_files`` (the study's evaluation trajectory
    files) exists is refused in one line: their history was erased."""
    content = {k: lock[k] for k in _CONTENT}
    with history_locked(lock_path) as path:
        history = read_history(path)
        check_chain(path, history)
        existing = [str(f) for f in evaluation_files if os.path.exists(f)]
        if not history and existing:
            more = f" and {len(existing) - 1} more" if len(existing) > 1 else ""
            raise PrespecificationError(
                f"{path}: no registration history, but evaluation trajectories of the study "
                f"exist ({existing[0]}{more}): the history was erased; it is append-only and "
                f"cannot be rebuilt: restore it, or start the study over by deleting "
                f"{Path(lock_path).parent} (its lock, history and evaluation trajectories)"
            )
        previous = history[-1]["lock"] if history else None
        if previous is not None and {k: previous[k] for k in _CONTENT} == content:
            last = history[-1]
            registered = {**previous}
            registration = {k: last[k] for k in ("number", "time", "reason")}
            registration.update(earlier=len(history) - 1, history=str(path))
        else:
            chain = {"number": len(history) + 1, "previous": previous["hash"] if previous else None}
            registered = {**content, "chain": chain}
            registered["hash"] = lock_hash(registered)
            stamp = (time or datetime.now(UTC)).isoformat(timespec="seconds")
            entry = {
                "number": chain["number"],
                "time": stamp,
                "reason": reason or _reason(previous, registered),
                "hash": registered["hash"],
                "lock": registered,
            }
            before = path.read_text(encoding="utf-8") if path.exists() else ""
            if before and not before.endswith("\n"):
                before += "\n"
            line = json.dumps(entry, sort_keys=True, separators=(",", ":"), allow_nan=False)
            atomic_write_text(path, before + line + "\n")
            registration = {k: entry[k] for k in ("number", "time", "reason")}
            registration.update(earlier=len(history), history=str(path))
        out = {**registered, "registration": registration}
        write_lock(out, lock_path)
    return out


def registration_line(lock: Mapping[str, Any]) -> str:
    """One line saying which registration of its study a lock is and how many came before."""
    reg = lock.get("registration")
    if not reg:
        return f"Lock {lock['hash']} of {lock['study']} (no registration record)."
    earlier = reg["earlier"]
    before = (
        "no earlier registration"
        if earlier == 0
        else (f"{earlier} earlier registration{'s' if earlier != 1 else ''}")
    )
    return (
        f"Registration {reg['number']} of {lock['study']} (lock {lock['hash']}, {reg['time']}; "
        f"{before}; {reg['reason']})."
    )


def endpoint_fingerprint(script: str | os.PathLike) -> str:
    """The fingerprint of the code that computes a study's endpoints: the script's own code
    (:func:`kvdiverge.pipeline.provenance.code_text`) and
    :func:`~kvdiverge.pipeline.provenance.script_fingerprint` of every package module it
    reaches; docstrings and comments aside."""
    source = Path(script).read_text(encoding="utf-8")
    text = f"{script_fingerprint(script)}\0{code_text(source)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
