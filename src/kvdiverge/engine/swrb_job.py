"""An SWRB rollout job: a stratum's documents under a study's actions → one SWRB record file per
action (`docs/method.md`, "Survival-weighted residual branching").

The counterpart of :func:`kvdiverge.engine.rollout_job.run_stratum_rollout_job` for
``coupling: swrb``, with the same checks before any work and the same resumable scratch area
(:func:`kvdiverge.engine.rollout_job.load_checked_job`,
:meth:`~kvdiverge.engine.rollout_job.CheckedJob.open_scratch`): the documents are chosen the same
way
(cohort → K per action), each prompt is chat-wrapped and prefilled once for all its actions,
and the actions with the same K run as one batch
(:func:`kvdiverge.engine.swrb_rollout.swrb_rollout_document`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import polars as pl
import torch

from kvdiverge.engine.kernels import kernel_choices
from kvdiverge.engine.rollout_job import job_actions, load_checked_job
from kvdiverge.engine.swrb_rollout import swrb_rollout_document, swrb_temperature_problem
from kvdiverge.eviction import ActionSpec, parse_action, run_prefill
from kvdiverge.io.swrb_records import (
    SWRB_METADATA_KEYS,
    SwrbRollout,
    swrb_frame,
    write_swrb_records,
)
from kvdiverge.models.checks import model_vocab_size

__all__ = ["run_swrb_job", "swrb_documents_actions"]

log = logging.getLogger(__name__)


def swrb_documents_actions(
    model: torch.nn.Module,
    tokenizer: Any,
    documents: Sequence[tuple[str, str, Mapping[str, int]]],
    actions: Sequence[ActionSpec | Mapping[str, Any]],
    eos_ids: Sequence[int],
    H: int,
    seed: int,
    max_batch_rows: int | None = None,
    temperature: float = 1.0,
) -> dict[str, pl.DataFrame]:
    """SWRB records of many documents: one table per action, documents in the order given.

    ``documents``: ``(doc_id, prompt, {action name: K})``; an action absent from a document's
    mapping does not run it. One prefill per document serves all its actions. The actions with
    the same K scan together, two rows per (action, replicate); ``max_batch_rows`` (None: no
    limit) caps those rows per model call by running the replicates in chunks, which changes
    no record (every uniform is keyed by replicate, :mod:`kvdiverge.engine.swrb_rollout`);
    ``temperature``: T > 0, the kernels are softmax(logits / T) (1: the model's own law).
    """
    if max_batch_rows is not None and max_batch_rows < 2:
        raise ValueError(f"max_batch_rows: expected at least 2, got {max_batch_rows}")
    problem = swrb_temperature_problem(temperature)
    if problem:
        raise ValueError(f"temperature: {problem}")
    from kvdiverge.models import chat_prompt_ids

    specs = {
        a.name: a for a in (x if isinstance(x, ActionSpec) else parse_action(x) for x in actions)
    }
    out: dict[str, list[SwrbRollout]] = {name: [] for name in specs}
    for doc_id, prompt, counts in documents:
        unknown = [name for name in counts if name not in specs]
        if unknown:
            raise ValueError(f"document {doc_id}: replicates for unknown action(s) {unknown}")
        ids = chat_prompt_ids(tokenizer, prompt)
        running = [specs[name] for name in counts]
        if not running:
            continue
        prefill = run_prefill(model, ids, actions=running)
        by_k: dict[int, list[ActionSpec]] = {}
        for spec in running:
            by_k.setdefault(int(counts[spec.name]), []).append(spec)
        for k, group in by_k.items():
            chunk = k if max_batch_rows is None else max(1, max_batch_rows // (2 * len(group)))
            for start in range(0, k, chunk):
                reps = list(range(start, min(k, start + chunk)))
                results = swrb_rollout_document(
                    model, ids, group, doc_id, reps, eos_ids, H, seed, prefill=prefill,
                    temperature=temperature,
                )  # fmt: skip
                for name, result in results.items():
                    out[name].append(result)
    return {name: swrb_frame(results) for name, results in out.items()}


def run_swrb_job(
    documents_path: str | os.PathLike,
    out_paths: Mapping[str, str | os.PathLike],
    model: Mapping[str, Any],
    actions: Mapping[str, Mapping[str, Any]],
    cohorts: Mapping[str, Mapping[str, int]],
    H: int,
    seed: int,
    device: str = "auto",
    metadata: Mapping[str, Any] | None = None,
    max_batch_rows: int | None = None,
    log_file: Any = None,
    resume_key: Any = None,
    temperature: float = 1.0,
) -> dict[str, pl.DataFrame]:
    """Run a job and write one SWRB record file per action (metadata as the trajectory files':
    model, action, H, K (cohort → K), seed, ``coupling: swrb``, ``temperature``, dtype, device,
    ``vocab_size`` (the model's: every token id lies below it, checked on read), n_documents,
    and ``documents``: the documents file and its SHA-256).

    ``model``: ``path`` (a local folder) and optionally ``name``, ``dtype``, ``revision``,
    ``trust_remote_code``;
    ``out_paths``, ``actions`` (spec dicts) and ``cohorts`` are keyed by action name;
    ``metadata``: extra keys for every file (the pipeline's ``lock`` hash,
    docs/prespecification.md, "Fixed by the lock"); they may not replace the keys above;
    ``max_batch_rows``: rows per scan call (:func:`swrb_documents_actions`); ``temperature``:
    the decoding temperature T > 0 (``rollout.temperature``), the kernels softmax(logits / T).

    Before any work, the model and every document are checked as in a trajectory rollout job
    (:func:`kvdiverge.engine.rollout_job.load_checked_job`: one line naming the config field, the
    file,
    or the doc_id and stratum). Each finished document is kept in the job's scratch area, so a
    job killed part-way resumes from its finished documents (``resume_key``: e.g. the code
    fingerprint, part of the scratch key) and writes the same files as an uninterrupted run.
    Progress goes to ``log_file`` (:class:`kvdiverge.pipeline.progress.RolloutProgress`: a bar on
    a terminal, else a plain line per document with rate and ETA) and one log line per document.
    """
    from kvdiverge.pipeline.progress import RolloutProgress

    extra = dict(metadata or {})
    clash = sorted(
        set(extra) & {*SWRB_METADATA_KEYS, "temperature", "eos_ids", "documents", "vocab_size"}
    )
    if clash:
        raise ValueError(f"metadata: key(s) {', '.join(clash)} are set by the job")
    problem = swrb_temperature_problem(temperature)
    if problem:
        raise ValueError(f"temperature: {problem}")
    specs = job_actions(actions, out_paths, cohorts)
    job = load_checked_job(documents_path, model, specs, cohorts, H, device)
    lm = job.model
    settings = {"H": H, "seed": seed, "coupling": "swrb", "temperature": temperature}
    scratch = job.open_scratch(out_paths, settings, resume_key)
    with RolloutProgress(len(job.documents), stream=log_file) as bar:  # no \r in a log file
        for document in job.documents:
            doc_id = document[0]
            if not scratch.done(doc_id):
                start = time.perf_counter()
                frames = swrb_documents_actions(
                    lm, job.tokenizer, [document], list(specs.values()), job.eos_ids, H, seed,
                    max_batch_rows, temperature,
                )  # fmt: skip
                scratch.save(doc_id, frames)
                log.info(
                    "%s: %d prompt tokens, %.1f s, %d replicates",
                    doc_id,
                    job.lengths.get(doc_id, -1),
                    time.perf_counter() - start,
                    sum(f.height for f in frames.values()),
                )
            bar.document(doc_id)
    saved = scratch.load_all()
    out = {}
    for name, spec in specs.items():
        parts = [saved[doc_id][0][name] for doc_id, _, _ in job.documents]
        frame = pl.concat(parts) if parts else swrb_frame([])
        write_swrb_records(
            frame,
            out_paths[name],
            {
                "model": {"name": model.get("name"), "path": str(model["path"])},
                "action": spec.as_dict(),
                "H": H,
                "K": dict(cohorts[name]),
                "seed": seed,
                "coupling": "swrb",
                "temperature": temperature,
                "dtype": str(lm.dtype).removeprefix("torch."),
                "device": str(lm.device),
                "kernel": kernel_choices(),  # which kernel each attention layout ran
                "eos_ids": list(job.eos_ids),
                "vocab_size": model_vocab_size(lm),  # every token id lies below it
                "n_documents": frame["doc_id"].n_unique(),
                "documents": job.documents_record,
                **extra,
            },
        )
        out[name] = frame
    scratch.clear()
    return out
