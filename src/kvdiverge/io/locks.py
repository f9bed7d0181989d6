"""Lock files (``docs/prespecification.md``, "Prespecification"): a study's registered design and
endpoints, hashed, written before any evaluation rollout and read back checked by every job
that relies on them. What goes into a lock is :mod:`kvdiverge.analysis.prespecification`'s; this
module reads and writes the file, its registration history and the rollout side, so that a
rollout job reaches no analysis code.

The rollout side of a lock (``rollout``): ``settings`` (H, seed, coupling, temperature, rows
per model call), ``code`` (the fingerprint of the code the evaluation rollout jobs run, Python
and native sources: :func:`kvdiverge.pipeline.provenance.script_fingerprint`) and per model
``models.<name>``: ``weights`` and ``tokenizer`` (:func:`kvdiverge.io.model_digest.model_digests`),
and the ``device``, ``dtype``, ``kernel`` and ``libraries`` its development rollouts ran with.
With ``design`` (actions, K, K_control) it is everything a path depends on:
:func:`rollout_view` flattens it, :func:`check_rollout` refuses a job that would run another
one, and :func:`check_trajectory` a trajectory file that records another one.

The history (``lock_history.jsonl`` beside the lock, :func:`read_history`): one registration a
line, each holding the registered lock, whose hashed ``chain`` names its number and the
previous registration's hash. :func:`check_history` verifies the chain and that the lock is the
history's last registration; :func:`history_locked` is the OS file lock its writers hold.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvdiverge.io.files import atomic_write_text

__all__ = [
    "AMENDMENT_FIELDS",
    "HISTORY_NAME",
    "LOCK_FIELDS",
    "PrespecificationError",
    "ROLLOUT_SETTINGS",
    "check_chain",
    "check_evaluation_documents",
    "check_history",
    "check_rollout",
    "check_trajectory",
    "evaluation_cohorts",
    "evaluation_documents_digest",
    "evaluation_seed",
    "file_view",
    "history_locked",
    "history_path",
    "lock_hash",
    "read_history",
    "read_lock",
    "redo",
    "rollout_view",
    "write_lock",
]

LOCK_FIELDS = ("study", "design", "endpoints", "plan", "rollout", "chain")
"""The hashed fields of a lock, besides ``hash`` itself."""

AMENDMENT_FIELDS = ("study", "group", "study_lock", "design", "endpoints", "rollout")
"""The hashed fields of a later group's amendment, besides ``hash`` itself."""

HISTORY_NAME = "lock_history.jsonl"
"""The registrations of a study's lock, one JSON line each, beside ``lock.json``."""

_RERUN = (
    "rerun the workflow to re-lock and roll out the evaluation cohort again "
    '(docs/prespecification.md, "Prespecification")'
)


def redo(file: str | os.PathLike) -> str:
    """The advice that works for an evaluation file that does not match its lock."""
    return f"delete {file} and rerun the workflow (its rollout job runs again under the lock)"


def _anew(path: str | os.PathLike) -> str:
    """The advice that works when a lock no longer holds: a new registration."""
    return (
        f"register anew: delete {path} and rerun the workflow (a new registration, appended to "
        f"{Path(path).with_name(HISTORY_NAME)}, with a new evaluation seed; "
        'docs/prespecification.md, "Changing it honestly")'
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
        raise PrespecificationError(
            f"{path}: lock lacks field(s) {', '.join(missing)} (written by an earlier version?); "
            f"{_anew(path)}"
        )
    if lock_hash(lock) != lock["hash"]:
        raise PrespecificationError(
            f"{path}: the lock's content does not match its hash {lock['hash']} (edited by "
            f"hand?); a lock is written only by rule prespecify: delete {path} and rerun the "
            f"workflow, which writes the registered lock again (to change what is registered, "
            f"change the config)"
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


# ---- the registration history ------------------------------------------------------------------


def history_path(lock_path: str | os.PathLike) -> Path:
    """The registration history beside a lock (:data:`HISTORY_NAME`)."""
    return Path(lock_path).with_name(HISTORY_NAME)


@contextlib.contextmanager
def history_locked(lock_path: str | os.PathLike) -> Iterator[Path]:
    """Hold the OS file lock (``fcntl.flock``, exclusive) of the history beside ``lock_path``
    (on the sidecar ``lock_history.jsonl.lock``, which is never replaced, so the history itself
    may be rewritten atomically): two writers sharing one output folder, even from two
    Snakemake working folders, register one after the other. Yields the history's path."""
    path = history_path(lock_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(HISTORY_NAME + ".lock"), "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield path
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def read_history(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every registration of a history file, oldest first (none when it does not exist); a
    line that is not a registration is one line naming the file and line."""
    path = Path(path)
    if not path.exists():
        return []
    entries = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PrespecificationError(
                f"{path}:{number}: not a registration ({exc.msg}); the history is append-only, "
                f"restore the line"
            ) from exc
        if not isinstance(entry, dict) or not {"number", "time", "reason", "lock"} <= set(entry):
            raise PrespecificationError(
                f"{path}:{number}: not a registration (expected number, time, reason, lock)"
            )
        entries.append(entry)
    return entries


def check_chain(path: str | os.PathLike, history: Sequence[Mapping[str, Any]]) -> None:
    """Refuse, in one line naming the line, a history whose registrations are not a chain:
    each entry's lock hashed as it says (:func:`lock_hash`), numbered 1, 2, ... and naming the
    previous entry's hash (``chain.previous``; ``None`` for the first)."""
    previous = None
    for i, entry in enumerate(history, 1):
        lock = entry["lock"]
        chain = lock.get("chain") if isinstance(lock, Mapping) else None
        where = f"{path}:{i}"
        if not isinstance(chain, Mapping) or any(k not in lock for k in (*LOCK_FIELDS, "hash")):
            raise PrespecificationError(
                f"{where}: a registration without its chain (written by an earlier version?); "
                f"the history is append-only: start the study over in a fresh output folder"
            )
        if lock_hash(lock) != lock["hash"] or entry.get("hash") != lock["hash"]:
            raise PrespecificationError(
                f"{where}: the registration's content does not match its hash {lock['hash']} "
                f"(edited by hand?); the history is append-only: restore the line"
            )
        if chain.get("number") != i or chain.get("previous") != previous:
            raise PrespecificationError(
                f"{where}: registration {chain.get('number')} names previous registration "
                f"{chain.get('previous')}, but the line before holds {previous} (a line "
                f"removed, reordered or inserted?); the history is append-only: restore it"
            )
        previous = lock["hash"]


def check_history(lock: Mapping[str, Any], lock_path: str | os.PathLike) -> list[dict[str, Any]]:
    """Refuse, in one line, a study lock that is not its history's last registration: a
    missing or broken history (:func:`check_chain`), or a lock whose hash or chain differs
    from the last entry's; return the history. An amendment (a lock with a ``group``) has no
    history of its own and passes."""
    if "group" in lock:
        return []
    path = history_path(lock_path)
    if not path.exists():
        raise PrespecificationError(
            f"{lock_path}: no registration history beside it ({path} is missing: erased?); the "
            f"history is append-only and cannot be rebuilt: restore {path}, or start the study "
            f"over by deleting {Path(lock_path).parent} (its lock, history and evaluation "
            f"trajectories)"
        )
    history = read_history(path)
    check_chain(path, history)
    last = history[-1]["lock"] if history else None
    if (
        last is None
        or last["hash"] != lock["hash"]
        or last != {k: lock.get(k) for k in (*LOCK_FIELDS, "hash")}
    ):
        registered = last["hash"] if last else "none"
        raise PrespecificationError(
            f"{lock_path}: lock {lock['hash']} is not the last registration of {path} "
            f"(registered: {registered}); a lock is written only by rule prespecify: delete "
            f"{lock_path} and rerun the workflow, which writes the registered lock again"
        )
    return history


# ---- the rollout side ----------------------------------------------------------------------------

ROLLOUT_SETTINGS = ("H", "seed", "coupling", "temperature", "max_batch_rows")
"""The rollout settings a lock registers in ``rollout.settings``."""

_MODEL_FIELDS = ("weights", "tokenizer", "device", "dtype", "kernel", "libraries")


def rollout_view(lock: Mapping[str, Any], model: str) -> dict[str, Any]:
    """Everything a path of ``model`` rolled out under ``lock`` depends on, flat by field:
    ``rollout.settings.<s>``, ``rollout.code``, ``rollout.models.<model>.<f>``, ``design.K``,
    ``design.K_control`` and ``design.actions.<name>`` (each action's spec). One line when
    the lock registers no rollout side or not ``model``."""
    rollout = lock.get("rollout")
    if not isinstance(rollout, Mapping):
        raise PrespecificationError(f"lock {lock['hash']}: registers no rollout side")
    models = rollout.get("models") or {}
    if model not in models:
        raise PrespecificationError(
            f"lock {lock['hash']}: model {model!r} is not registered (registered: "
            f"{', '.join(models) or 'none'})"
        )
    design = lock["design"]
    view = {f"rollout.settings.{k}": rollout["settings"].get(k) for k in ROLLOUT_SETTINGS}
    view["rollout.code"] = rollout.get("code")
    view.update({f"rollout.models.{model}.{k}": models[model].get(k) for k in _MODEL_FIELDS})
    view.update({"design.K": design["K"], "design.K_control": design["K_control"]})
    view.update({f"design.actions.{name}": spec for name, spec in design["actions"].items()})
    return view


def _device_type(device: Any) -> Any:
    return device.split(":")[0] if isinstance(device, str) else device


def _same(field: str, locked: Any, now: Any) -> bool:
    """Equal, up to a device's index (``cuda:1`` runs what ``cuda`` registered) and, for a
    kernel, on the layouts both name (a layout one of them never ran has no kernel to
    compare)."""
    if field.endswith(".device"):
        return _device_type(locked) == _device_type(now)
    if field.endswith(".kernel") and isinstance(locked, Mapping) and isinstance(now, Mapping):
        return all(locked[k] == now[k] for k in set(locked) & set(now))
    return locked == now


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def check_rollout(
    lock: Mapping[str, Any], lock_path: str | os.PathLike, model: str, would_run: Mapping[str, Any]
) -> None:
    """Refuse, in one line naming the field, an evaluation rollout job of ``model`` whose
    ``would_run`` (fields of :func:`rollout_view`: what it would run, found before any
    compute) differs from what ``lock`` registered."""
    view = rollout_view(lock, model)
    for field, now in would_run.items():
        locked = view.get(field)
        if not _same(field, locked, now):
            raise PrespecificationError(
                f"{lock_path}: this evaluation rollout of {model} would run {field} = "
                f"{_short(now)}, but the lock registered {_short(locked)}; {_anew(lock_path)}"
            )


def file_view(meta: Mapping[str, Any]) -> dict[str, Any]:
    """What a trajectory file's metadata records of the fields of :func:`rollout_view`."""
    model = (meta.get("model") or {}).get("name")
    digest = meta.get("model_digest") or {}
    action = meta.get("action") or {}
    view = {f"rollout.settings.{k}": meta.get(k) for k in ROLLOUT_SETTINGS}
    view["rollout.code"] = meta.get("code")
    view.update(
        {
            f"rollout.models.{model}.weights": digest.get("weights"),
            f"rollout.models.{model}.tokenizer": digest.get("tokenizer"),
            f"rollout.models.{model}.device": meta.get("device"),
            f"rollout.models.{model}.dtype": meta.get("dtype"),
            f"rollout.models.{model}.kernel": meta.get("kernel"),
            f"rollout.models.{model}.libraries": meta.get("libraries"),
            f"design.actions.{action.get('name')}": action,
        }
    )
    return view


def check_trajectory(
    file: str | os.PathLike,
    meta: Mapping[str, Any],
    lock: Mapping[str, Any],
    lock_path: str | os.PathLike,
) -> None:
    """Refuse, in one line naming the file and the field, an evaluation trajectory file whose
    recorded settings, model digests, code, kernel, device, dtype or libraries are not those
    ``lock`` registered, or whose seed is not the lock's evaluation seed, or whose replicates
    are not the lock's K (K_control for the control)."""
    model = (meta.get("model") or {}).get("name")
    if model not in ((lock.get("rollout") or {}).get("models") or {}):
        raise PrespecificationError(
            f"{file}: rolled out with model {model!r}, which {lock_path} does not register; "
            f"{redo(file)}"
        )
    action = (meta.get("action") or {}).get("name")
    if action not in lock["design"]["actions"]:
        raise PrespecificationError(
            f"{file}: rolled out under action {action!r}, which {lock_path} does not register; "
            f"{redo(file)}"
        )
    view = rollout_view(lock, model)
    recorded = file_view(meta)
    recorded["rollout.settings.seed"] = meta.get("seed")
    expected = dict(view)
    expected["rollout.settings.seed"] = evaluation_seed(lock)
    cohort = lock["design"]["cohort"]
    replicates = lock["design"]["K_control"] if action == lock["design"]["control"] else None
    expected["K"] = {cohort: replicates if replicates is not None else lock["design"]["K"]}
    recorded["K"] = meta.get("K")
    for field, now in recorded.items():
        if field not in expected:
            continue
        if not _same(field, expected[field], now):
            seed = " (the lock's evaluation seed)" if field.endswith(".seed") else ""
            raise PrespecificationError(
                f"{file}: records {field} = {_short(now)}, but {lock_path} registered "
                f"{_short(expected[field])}{seed}; {redo(file)}"
            )
