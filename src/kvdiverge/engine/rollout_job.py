"""The rollout job: a stratum's documents → coupled rollouts of every action → trajectory files.

One job of rule ``rollout_<study>`` (``docs/architecture.md``, "Rollout jobs"): read the
documents of the job's cohorts, load the model once, run every document through
:func:`kvdiverge.engine.batches.batched_paths` (one prefill per document for all actions; each
model call holds the rows of several documents), convert the results to the trajectory table
(:data:`kvdiverge.io.trajectories.TRAJECTORY_SCHEMA`, one row per document, replicate and step) and
write one file per action with its metadata.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import polars as pl
import torch

from kvdiverge.engine.batches import batched_paths
from kvdiverge.engine.device_memory import check_device_memory
from kvdiverge.engine.job_records import (
    LIBRARIES,
    cache_bytes_record,
    library_versions,
    sum_timing,
    with_cache_bytes,
)
from kvdiverge.engine.kernels import kernel_choices
from kvdiverge.engine.settings import ActionPaths, RolloutSettings
from kvdiverge.eviction import ActionSpec, parse_action
from kvdiverge.io import JobScratch, sha256_file
from kvdiverge.io.documents import read_documents, read_documents_table
from kvdiverge.io.locks import ROLLOUT_SETTINGS, PrespecificationError
from kvdiverge.io.model_digest import model_digests
from kvdiverge.io.trajectories import METADATA_KEYS, TRAJECTORY_SCHEMA
from kvdiverge.models.checks import model_vocab_size

__all__ = [
    "LIBRARIES",
    "PROVENANCE_KEYS",
    "TIMING_KEYS",
    "CheckedJob",
    "add_timing",
    "check_registered_numerics",
    "batched_prompt_paths",
    "job_actions",
    "job_code",
    "library_versions",
    "load_checked_job",
    "trajectory_tables",
    "run_stratum_rollout_job",
    "select_documents",
    "select_job_documents",
    "trajectory_frame",
    "would_run",
]

log = logging.getLogger(__name__)

TIMING_KEYS = ("documents", "paths", "prefill_seconds", "selection_seconds", "decode_seconds")

PROVENANCE_KEYS = ("model_digest", "kernel", "libraries", "max_batch_rows", "batch_rows")
"""Metadata keys of a trajectory file that say what computed it, besides ``dtype``, ``device``
and ``code`` (:func:`run_stratum_rollout_job`)."""


def job_code(script: str | os.PathLike, actions: Mapping[str, Mapping[str, Any]]) -> str:
    """The fingerprint of the code a rollout job of ``actions`` runs from ``script``: the
    package modules it reaches and their native sources, with only its actions' selectors
    (:func:`kvdiverge.pipeline.provenance.script_fingerprint`; the same as the rollout rule's
    ``code`` param, found again in the job)."""
    from kvdiverge.pipeline.provenance import script_fingerprint

    selectors = set()
    for name, spec in actions.items():
        method = parse_action(spec, name=name).method
        selectors.add(f"{type(method).__module__}:{type(method).__qualname__}")
    return script_fingerprint(script, selectors=sorted(selectors))


def would_run(
    code: str,
    model: Mapping[str, Any],
    actions: Mapping[str, Mapping[str, Any]],
    settings: Mapping[str, Any],
    device: str = "auto",
) -> dict[str, Any]:
    """What an evaluation rollout job would run, found before loading the model, as fields of
    :func:`kvdiverge.io.locks.rollout_view`: the ``settings`` (H, seed — the config's, before
    the lock's evaluation seed replaces it —, coupling, temperature, max_batch_rows), ``code``,
    each action's spec, and
    the model's digests, libraries, device type and dtype (as :func:`kvdiverge.models.load_model`
    will resolve them)."""
    from kvdiverge.models.loading import resolve_device, resolve_dtype

    name = model.get("name") or str(model["path"])
    digest = model_digests(model["path"]) or {}
    resolved = resolve_device(device)
    fields: dict[str, Any] = {
        **{f"rollout.settings.{k}": settings[k] for k in ROLLOUT_SETTINGS},
        "rollout.code": code,
        f"rollout.models.{name}.weights": digest.get("weights"),
        f"rollout.models.{name}.tokenizer": digest.get("tokenizer"),
        f"rollout.models.{name}.libraries": library_versions(),
        f"rollout.models.{name}.device": resolved.type,
        f"rollout.models.{name}.dtype": str(
            resolve_dtype(model.get("dtype", "auto"), resolved)
        ).removeprefix("torch."),
    }
    for action, spec in actions.items():
        fields[f"design.actions.{action}"] = parse_action(spec, name=action).as_dict()
    return fields


def check_registered_numerics(
    registered: Mapping[str, Any], model: Mapping[str, Any], found: Mapping[str, Any]
) -> None:
    """Refuse, in one line naming the field, a job whose ``found`` ``dtype``, ``device`` (its
    type) or ``kernel`` (on the layouts both name) are not those its lock ``registered``
    (``rollout.models.<name>``)."""
    name = model.get("name") or model["path"]
    for field, now in found.items():
        locked = registered.get(field)
        if field == "device":
            same = str(now).split(":")[0] == str(locked).split(":")[0]
        elif field == "kernel":
            same = all(locked[k] == now[k] for k in set(locked or {}) & set(now))
        else:
            same = now == locked
        if not same:
            raise PrespecificationError(
                f"rollout.models.{name}.{field}: this evaluation rollout runs {now!r}, but the "
                f"lock registered {locked!r} (from the development rollouts); run it where the "
                f"development ran, or register anew: delete the study's lock.json and rerun the "
                f"workflow"
            )


def trajectory_frame(rollouts: Iterable[ActionPaths]) -> pl.DataFrame:
    """Long table of the trajectory contract: one row per (document, replicate, step)."""
    frames = []
    for r in rollouts:
        k, h = r.x_token.shape
        frames.append(
            pl.DataFrame(
                {
                    "doc_id": np.repeat(np.array([r.doc_id], dtype=object), k * h),
                    "replicate": np.repeat(r.replicates, h),
                    "t": np.tile(np.arange(1, h + 1), k),
                    "x_token": r.x_token.reshape(-1),
                    "y_token": r.y_token.reshape(-1),
                    "mismatch": (r.x_token != r.y_token).reshape(-1),
                    "tv_rollout": r.tv_rollout.reshape(-1),
                    "tv_fixed": r.tv_fixed.reshape(-1),
                    "x_eos": r.x_eos.reshape(-1),
                    "y_eos": r.y_eos.reshape(-1),
                    "n_prompt": np.full(k * h, r.n_prompt),
                    "n_kept": np.full(k * h, r.n_kept),
                },
                schema_overrides={"doc_id": pl.String},
            ).cast(TRAJECTORY_SCHEMA)
        )
    if not frames:
        return pl.DataFrame(schema=TRAJECTORY_SCHEMA)
    return pl.concat(frames)


def add_timing(timing: dict[str, dict[str, float]], name: str, result: ActionPaths) -> None:
    """Add one document's seconds of action ``name`` to the per-action sums of ``timing``."""
    sums = timing.setdefault(name, dict.fromkeys(TIMING_KEYS, 0))
    sums["documents"] += 1
    sums["paths"] += len(result.replicates)
    sums["prefill_seconds"] += result.prefill_seconds
    sums["selection_seconds"] += result.selection_seconds
    sums["decode_seconds"] += result.decode_seconds


def batched_prompt_paths(
    model: torch.nn.Module,
    tokenizer: Any,
    documents: Sequence[tuple[str, str, Mapping[str, int]]],
    actions: Sequence[ActionSpec | Mapping[str, Any]],
    eos_ids: Sequence[int],
    settings: RolloutSettings,
    skip: Any = None,
    on_step: Any = None,
) -> Iterator[tuple[str, dict[str, ActionPaths]]]:
    """``(doc_id, {action name: ActionPaths})`` per document, in order, as its batches
    finish: :func:`kvdiverge.engine.batches.batched_paths` over the chat-wrapped prompts, so
    each model call holds the rows of as many documents as ``settings.max_batch_rows`` allows.

    ``documents``: ``(doc_id, prompt, {action name: K})``; an action absent from a document's
    mapping does not run it. ``skip(doc_id)``: a document already done (a resumed job).
    """
    from kvdiverge.models import chat_prompt_ids

    specs = [a if isinstance(a, ActionSpec) else parse_action(a) for a in actions]
    known = {a.name for a in specs}
    for doc_id, _, counts in documents:  # every document checked before any model call
        unknown = [name for name in counts if name not in known]
        if unknown:
            raise ValueError(f"document {doc_id}: replicates for unknown action(s) {unknown}")
    inputs = [
        (doc_id, chat_prompt_ids(tokenizer, prompt), dict(counts))
        for doc_id, prompt, counts in documents
        if counts
    ]
    yield from batched_paths(model, inputs, specs, eos_ids, settings, skip=skip, on_step=on_step)


def trajectory_tables(
    model: torch.nn.Module,
    tokenizer: Any,
    documents: Iterable[tuple[str, str, Mapping[str, int]]],
    actions: Sequence[ActionSpec | Mapping[str, Any]],
    eos_ids: Sequence[int],
    settings: RolloutSettings,
    progress: Any = None,
    timing: dict[str, dict[str, float]] | None = None,
    on_step: Any = None,
    cache_bytes: dict[str, dict[str, Any]] | None = None,
) -> dict[str, pl.DataFrame]:
    """Coupled rollouts of many documents under several actions: one trajectory table per action.

    ``documents``: ``(doc_id, prompt, {action name: K})``; an action absent from a document's
    mapping does not run it. Each prompt is wrapped by the tokenizer's chat template
    and prefilled once for all its actions, and each model call holds the rows of several
    documents (:func:`batched_prompt_paths`, :func:`kvdiverge.engine.batches.batched_paths`): every
    document's values equal its one-document run
    (:func:`kvdiverge.engine.document.paths_under_actions`) to
    floating-point rounding. Each action's table lists its documents in the order given.
    ``progress``: optional tqdm-like object updated once per document; ``on_step``: the
    engine's step hook (:func:`kvdiverge.engine.batches.batched_paths`). ``timing``: optional
    dict filled with, per action name, the sums over its documents of ``documents``,
    ``paths`` and the seconds of the rollout (``prefill_seconds``: each document's shared
    prefill, counted in full for every action that runs it; ``selection_seconds``;
    ``decode_seconds``, the action's share of the batches its documents ran in).
    ``cache_bytes``: optional dict filled with each action's cache bytes by ``doc_id``.
    """
    specs = [a if isinstance(a, ActionSpec) else parse_action(a) for a in actions]
    rollouts: dict[str, list[ActionPaths]] = {a.name: [] for a in specs}
    documents = list(documents)
    ran = batched_prompt_paths(
        model, tokenizer, documents, specs, eos_ids, settings, on_step=on_step
    )
    for doc_id, results in ran:
        for name, result in results.items():
            rollouts[name].append(result)
            if cache_bytes is not None:
                cache_bytes.setdefault(name, {})[doc_id] = result.cache_bytes
            if timing is not None:
                add_timing(timing, name, result)
        if progress is not None:
            progress.update(1)
    return {name: trajectory_frame(results) for name, results in rollouts.items()}


DOCUMENT_COLUMNS = ("doc_id", "cohort", "prompt")


def select_documents(
    path: str | os.PathLike, cohorts: Mapping[str, int]
) -> list[tuple[str, str, int]]:
    """``(doc_id, prompt, K)`` for the documents of ``path`` in ``cohorts``.

    ``cohorts`` maps a cohort name to its replicate count (e.g. ``{dev: K_dev, study1: K}``).
    Sorted by cohort order, then doc_id. The table is read by
    :func:`kvdiverge.io.documents.read_documents` (one-line errors naming the file).
    """
    frame = read_documents(path, columns=DOCUMENT_COLUMNS)
    out = []
    for cohort, k in cohorts.items():
        rows = frame.filter(pl.col("cohort") == cohort).sort("doc_id")
        out.extend((d, p, int(k)) for d, p in zip(rows["doc_id"], rows["prompt"], strict=True))
    return out


def select_job_documents(
    path: str | os.PathLike, cohorts: Mapping[str, Mapping[str, int]]
) -> list[tuple[str, str, dict[str, int]]]:
    """``(doc_id, prompt, {action: K})`` for a job of several actions.

    ``cohorts[action]`` maps cohort → K as in :func:`select_documents`. Documents come in the
    order of the first action that runs them (each action's own order is the same when the
    actions list the same cohorts, as a study's do).
    """
    order: dict[str, tuple[str, dict[str, int]]] = {}
    for action, per_cohort in cohorts.items():
        for doc_id, prompt, k in select_documents(path, per_cohort):
            order.setdefault(doc_id, (prompt, {}))[1][action] = k
    return [(doc_id, prompt, counts) for doc_id, (prompt, counts) in order.items()]


def job_actions(
    actions: Mapping[str, Mapping[str, Any]],
    out_paths: Mapping[str, Any],
    cohorts: Mapping[str, Any],
) -> dict[str, ActionSpec]:
    """A rollout job's action specs by name (:func:`kvdiverge.eviction.parse_action`), once
    ``actions``, ``out_paths`` and ``cohorts`` are known to name the same actions and each spec
    that carries a ``name`` carries its own key. Raises ``ValueError`` naming the argument."""
    for name, spec in actions.items():
        if spec.get("name", name) != name:
            raise ValueError(f"actions.{name}: the spec is named {spec['name']!r}")
    specs = {name: parse_action(spec, name=name) for name, spec in actions.items()}
    for field, given in (("out_paths", out_paths), ("cohorts", cohorts)):
        if set(given) != set(specs):
            raise ValueError(
                f"{field}: expected one entry per action ({', '.join(specs)}), "
                f"got {', '.join(given) or 'none'}"
            )
    return specs


@dataclass(frozen=True)
class CheckedJob:
    """A rollout job's inputs once checked (:func:`load_checked_job`): its tokenizer and loaded
    model, EOS ids, the documents it runs (``(doc_id, prompt, {action: K})``,
    :func:`select_job_documents`), each document's chat-wrapped prompt length, and the job's
    own specification (documents file and its SHA-256 as it was read, model entry, actions,
    cohort → K per action)."""

    tokenizer: Any
    model: torch.nn.Module
    eos_ids: list[int]
    documents: list[tuple[str, str, dict[str, int]]]
    lengths: dict[str, int]
    documents_path: str
    documents_sha256: str
    model_spec: dict[str, Any]
    specs: dict[str, ActionSpec]
    cohorts: dict[str, dict[str, int]]
    batch_rows: int | None = None  # max_batch_rows auto as sized to the device

    def open_scratch(
        self,
        out_paths: Mapping[str, str | os.PathLike],
        settings: Mapping[str, Any],
        resume_key: Any = None,
    ) -> JobScratch:
        """The job's scratch area (:class:`kvdiverge.io.JobScratch`), keyed by everything that
        decides its results: model entry, actions, cohorts, ``settings`` (H, seed, coupling...),
        the documents file's digest, dtype, device and ``resume_key`` (e.g. the code
        fingerprint). A job with any of them changed starts afresh. Logs the job's first line:
        model, actions, documents (and how many resume), H and EOS ids."""
        scratch = JobScratch(
            out_paths,
            key={
                "model": dict(self.model_spec),
                "actions": {name: spec.as_dict() for name, spec in self.specs.items()},
                "cohorts": self.cohorts,
                "settings": dict(settings),
                "documents": self.documents_sha256[:16],
                "dtype": str(self.model.dtype),
                "device": str(self.model.device),
                "resume": resume_key,
            },
        )
        resumed = sum(scratch.done(doc_id) for doc_id, _, _ in self.documents)
        log.info(
            "model %s (%s, %s on %s); actions %s; %d documents (%d resumed from %s); H=%s; EOS %s",
            self.model_spec.get("name", self.model_spec["path"]),
            self.model_spec["path"],
            self.model.dtype,
            self.model.device,
            ", ".join(self.specs),
            len(self.documents),
            resumed,
            scratch.root,
            settings.get("H"),
            self.eos_ids,
        )
        return scratch

    @property
    def documents_record(self) -> dict[str, str]:
        """The ``documents`` metadata of the job's files: the documents file and its SHA-256
        (the analysis refuses a documents file that differs)."""
        return {"file": self.documents_path, "sha256": self.documents_sha256}


def load_checked_job(
    documents_path: str | os.PathLike,
    model: Mapping[str, Any],
    specs: Mapping[str, ActionSpec],
    cohorts: Mapping[str, Mapping[str, int]],
    H: int,
    device: str = "auto",
    max_batch_rows: int | str | None = None,
) -> CheckedJob:
    """Check a rollout job's model and documents, then load the model: what every rollout job
    (trajectories or SWRB records) does before its first rollout.

    Before loading the weights: the model (a local folder: config, weights, chat template and
    context window, :func:`kvdiverge.engine.preflight.check_model_source`) and every document of the
    job's cohorts against every action and the model's window
    (:func:`kvdiverge.engine.preflight.check_documents`, lengths from the job model's own tokenizer
    and chat template); after loading a model that is not a local folder, its template and
    window (:func:`kvdiverge.engine.preflight.check_loaded_model`). Each failure is one line naming
    the config field (``config.models.<name>.path``), the file, or the doc_id and stratum.
    ``model``: ``path`` and optionally ``name``, ``dtype``, ``revision``, ``trust_remote_code``;
    ``specs`` by name; ``cohorts``: action → cohort → K; ``max_batch_rows``: memory plan
    (CUDA; ``auto`` sized to the device, :attr:`CheckedJob.batch_rows`: ``engine.device_memory``).
    """
    from kvdiverge.engine.families import check_loaded_attention
    from kvdiverge.engine.preflight import check_documents, check_loaded_model, check_model_source
    from kvdiverge.models import (
        chat_prompt_ids,
        eos_token_ids,
        load_model,
        load_tokenizer,
        resolve_device,
    )

    resolve_device(device)  # first: a job promised a GPU that has none stops here, in one line
    where = f"config.models.{model.get('name') or model['path']}.path"
    info = check_model_source(model, where)
    trust = bool(model.get("trust_remote_code", False))
    tokenizer = load_tokenizer(
        model["path"], trust_remote_code=trust, revision=model.get("revision")
    )
    job_cohorts = {c for per in cohorts.values() for c in per}
    digest = sha256_file(documents_path)  # before reading: the job's files record what it ran
    checked = check_documents(
        read_documents_table(documents_path),
        specs,
        info.get("max_positions") if info else None,
        H,
        str(documents_path),
        length_fn=lambda prompt: len(chat_prompt_ids(tokenizer, prompt)),
        cohorts=job_cohorts,
    )
    lengths = dict(zip(checked["doc_id"], checked["n_tokens"], strict=True))
    if info is not None:  # the window and the attention family against the job's own lengths
        check_model_source(model, where, max(lengths.values(), default=0) + H)
    documents = select_job_documents(documents_path, {name: cohorts[name] for name in specs})
    if not documents:
        log.warning("%s: no documents of the job's cohorts", documents_path)
    mem = check_device_memory(model, specs, cohorts, [*lengths.values()], H, max_batch_rows, device)
    lm = load_model(
        model["path"],
        device=device,
        dtype=model.get("dtype", "auto"),
        revision=model.get("revision"),
        trust_remote_code=trust,
    )
    if info is None:
        check_loaded_model(lm, tokenizer, where, max(lengths.values(), default=0) + H)
    check_loaded_attention(lm, where, max(lengths.values(), default=0) + H)
    return CheckedJob(
        tokenizer,
        lm,
        eos_token_ids(lm, tokenizer),
        documents,
        lengths,
        str(documents_path),
        digest,
        dict(model),
        dict(specs),
        {name: dict(cohorts[name]) for name in specs},
        mem.max_batch_rows if mem is not None and max_batch_rows == "auto" else None,
    )


def run_stratum_rollout_job(
    documents_path: str | os.PathLike,
    out_paths: Mapping[str, str | os.PathLike],
    model: Mapping[str, Any],
    actions: Mapping[str, Mapping[str, Any]],
    cohorts: Mapping[str, Mapping[str, int]],
    settings: RolloutSettings,
    device: str = "auto",
    log_file: Any = None,
    resume_key: Any = None,
    metadata: Mapping[str, Any] | None = None,
    registered: Mapping[str, Any] | None = None,
    max_batch_rows: int | str | None = None,
) -> dict[str, pl.DataFrame]:
    """One rollout job of the pipeline: a stratum's documents under every action of a study →
    one trajectory file per action.

    Before any work: the action names, the model (a local folder: config, weights, chat
    template and context window, :func:`kvdiverge.engine.preflight.check_model_source`) and every
    document of the job against every action and the model's window
    (:func:`kvdiverge.engine.preflight.check_documents`, with the job model's own tokenizer); each
    failure is one line naming the config field, the file, or the doc_id and stratum. The
    model then loads once and each document is prefilled once for all actions
    (:func:`trajectory_tables`); every file equals the one a job of that action alone
    writes up to floating-point rounding of δ and f.

    Each finished document is kept in a job-scoped scratch area
    (:class:`kvdiverge.io.JobScratch`) beside the outputs, so a job killed part-way resumes
    from its finished documents when rerun, and writes the same files as an uninterrupted run.
    The scratch is keyed by everything that decides the results (model, actions, cohorts,
    settings, the documents file's digest and ``resume_key``, e.g. the code fingerprint): a
    changed job starts afresh. ``out_paths``, ``actions`` (spec dicts) and ``cohorts`` (cohort
    → K) are keyed by action name. Progress goes to ``log_file``
    (:class:`kvdiverge.pipeline.progress.RolloutProgress`: bars on a terminal, else plain lines
    by document and, every few seconds, by decode step, with rate and ETA) and
    one log line per document (its tokens, seconds and fraction of paths diverged). Each
    file's metadata key ``timing`` holds the action's measured seconds (sample-size planning
    reads them): the only part of a file that differs between reruns; ``documents`` the
    documents file and its SHA-256 (:attr:`CheckedJob.documents_record`). ``metadata``: further
    keys written into every file's metadata (besides the job's own, among them the settings'
    ``temperature``; e.g. ``lock``, the hash of the evaluation's
    prespecification lock, and ``code``, the fingerprint of the code the job runs); it may not
    replace a key the job writes itself.

    Provenance (:data:`PROVENANCE_KEYS`): every file records ``model_digest`` (the model
    folder's weights and tokenizer digests, :func:`kvdiverge.io.model_digest.model_digests`),
    ``kernel`` (:func:`kvdiverge.engine.kernels.kernel_choices`: the kernel each attention
    layout ran in this job), ``libraries`` (the versions of torch, transformers and kvpress),
    ``max_batch_rows``, and the ``dtype`` and ``device`` the model ran in. ``registered``: the
    lock's ``rollout.models`` entry of an evaluation job's model; the job refuses, in one line
    naming the field, a loaded model of another dtype or device (before any rollout), and
    kernels other than those registered (before writing any file, its scratch cleared).
    ``max_batch_rows``: the configured rows a call in place of ``settings``' (``auto``: sized to
    the device, :mod:`kvdiverge.engine.device_memory`), recorded as ``max_batch_rows`` beside the
    rows run, ``batch_rows`` (only rounding depends on them; the rows run key the scratch).
    """
    from kvdiverge.io.trajectories import write_trajectories
    from kvdiverge.pipeline.progress import RolloutProgress

    specs = job_actions(actions, out_paths, cohorts)
    extra = dict(metadata or {})
    written = {*METADATA_KEYS, "temperature", "eos_ids", "n_documents", "timing", "documents"}
    written.add("cache_bytes")
    reserved = sorted(set(extra) & (written | set(PROVENANCE_KEYS)))
    if reserved:
        raise ValueError(f"metadata: key(s) {', '.join(reserved)} are written by the job itself")
    digest = model_digests(model["path"])
    configured = settings.max_batch_rows if max_batch_rows is None else max_batch_rows
    job = load_checked_job(documents_path, model, specs, cohorts, settings.H, device, configured)
    rows = settings.max_batch_rows if configured == "auto" else configured
    run = replace(settings, max_batch_rows=job.batch_rows or rows)
    lm, eos, documents = job.model, job.eos_ids, job.documents
    dtype = str(lm.dtype).removeprefix("torch.")
    if registered is not None:  # an evaluation job: the lock's numerics, before any rollout
        check_registered_numerics(registered, model, {"dtype": dtype, "device": str(lm.device)})
    scratch = job.open_scratch(out_paths, asdict(run), resume_key)
    resumed = [doc_id for doc_id, _, _ in documents if scratch.done(doc_id)]
    bar = RolloutProgress(len(documents), stream=log_file, done=len(resumed))
    with bar:
        rollouts = batched_prompt_paths(
            lm,
            job.tokenizer,
            documents,
            list(specs.values()),
            eos,
            run,
            skip=set(resumed).__contains__,
            on_step=bar.on_step,
        )
        for doc_id, results in rollouts:
            timing: dict[str, dict[str, float]] = {}
            for name, result in results.items():
                add_timing(timing, name, result)
            frames = {
                name: trajectory_frame([results[name]] if name in results else []) for name in specs
            }
            scratch.save(doc_id, frames, info=with_cache_bytes(timing, results))
            diverged = [
                f.group_by("replicate").agg(pl.col("mismatch").any()) for f in frames.values()
            ]
            paths = sum(d.height for d in diverged)
            share = sum(int(d["mismatch"].sum()) for d in diverged) / max(paths, 1)
            log.info(
                "%s: %d prompt tokens, %.1f s, %.0f%% of %d paths diverged within H",
                doc_id,
                job.lengths.get(doc_id, -1),
                next(iter(results.values())).document_seconds,
                100 * share,
                paths,
            )
            bar.document(doc_id)
    kernels = kernel_choices()
    if registered is not None:
        try:
            check_registered_numerics(registered, model, {"kernel": kernels})
        except ValueError:
            scratch.clear()  # its documents ran on other kernels: none may be resumed
            raise
    saved = scratch.load_all()
    order = [doc_id for doc_id, _, _ in documents]
    timing = sum_timing((saved[doc_id][1] for doc_id in order), TIMING_KEYS)
    out = {}
    for name, spec in specs.items():
        parts = [saved[doc_id][0][name] for doc_id in order if name in saved[doc_id][0]]
        frame = pl.concat(parts) if parts else pl.DataFrame(schema=TRAJECTORY_SCHEMA)
        file_metadata = {
            "model": {"name": model.get("name"), "path": str(model["path"])},
            "revision": model.get("revision"),
            "action": spec.as_dict(),
            "H": settings.H,
            "K": dict(cohorts[name]),
            "seed": settings.seed,
            "coupling": settings.coupling,
            "temperature": settings.temperature,
            "dtype": dtype,
            "device": str(lm.device),
            "model_digest": digest,
            "kernel": kernels,
            "libraries": library_versions(),
            "max_batch_rows": configured,
            "batch_rows": run.max_batch_rows,
            "eos_ids": list(eos),
            "vocab_size": model_vocab_size(lm),  # every token id lies below it
            "n_documents": frame["doc_id"].n_unique(),
            "documents": job.documents_record,
            "timing": timing.get(spec.name, dict.fromkeys(TIMING_KEYS, 0)),
            "cache_bytes": cache_bytes_record({d: saved[d][1] for d in order}, order, name),
        }
        write_trajectories(frame, out_paths[name], {**extra, **file_metadata})
        out[name] = frame
    scratch.clear()
    return out
