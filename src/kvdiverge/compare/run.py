"""A small study without Snakemake: one model, one prompts file, a few actions.

:func:`compare` runs the pipeline's own steps in one process, in the order the workflow runs
them: the prompts become a ``custom`` stratum's documents (:mod:`kvdiverge.datasets.custom`,
prompts as given), the model and every document are checked before the model loads
(:mod:`kvdiverge.engine.preflight`), the coupled rollouts run through
:func:`kvdiverge.engine.rollout_job.trajectory_tables` and are written as trajectory
files, the document statistics, estimands and accuracy follow (:mod:`kvdiverge.analysis`), and
Table 1, the figure-5 divergence CDF, the accuracy table and figure, the generations side by side
and, with a baseline, the contrasts against it are written into one folder. It returns the tables
as polars frames.

Actions are ``[LABEL=]SELECTOR[@BUDGET][+KEY=VALUE]...`` items
(:mod:`kvdiverge.compare.actions`): ``snapkv@0.5``, ``mine=my_methods:SinkStride@0.5``,
``snapkv@0.5+window=16``, ``kvpress@0.5+press=KnormPress`` — the ``selector``, ``budget`` and
parameters of a config's action entry (:func:`kvdiverge.eviction.parse_action`); the label (the
spec text when none is given) is the action's name in every table and figure, escaped in file
names.

Namesake: :mod:`kvdiverge.eviction.run` runs one prompt's prefill and an action's selection, a
step of this run.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from kvdiverge.compare.actions import (
    CompareError,
    LabelledAction,
    baseline_method,
    contrast_pairs,
    parse_actions,
    parse_budgets,
    sweep_budgets,
    with_baseline,
)
from kvdiverge.compare.folder import check_out, claim_out, finish_out
from kvdiverge.compare.inputs import (
    COHORT,
    STUDY,
    check_budget_lengths,
    check_numbers,
    check_prompt_records,
    name_user_prompt,
    replicates_problem,
    user_documents,
    window_hint,
)
from kvdiverge.compare.record import folder_metrics, metric_name
from kvdiverge.compare.tasks import (
    TaskSuite,
    check_task_numbers,
    parse_tasks,
    task_documents,
    task_keys,
)
from kvdiverge.pipeline.progress import RolloutProgress, quiet_library_bars

__all__ = ["CompareResult", "compare", "planned_files"]


_TABLE_FORMATS = ("csv", "md", "tex", "html")


@dataclass
class CompareResult:
    """What :func:`compare` computed: the long estimands and accuracy tables, Table 1 and the
    accuracy table (their CSV frames), the pooled divergence CDF (action, t, value, interval),
    the documents, every path's texts side by side with their scores and divergence step τ
    (``generations``), the contrasts against the baseline and their sentences (empty without a
    baseline), and the paths written (by name)."""

    estimands: pl.DataFrame
    table1: pl.DataFrame
    divergence_cdf: pl.DataFrame
    accuracy: pl.DataFrame
    accuracy_table: pl.DataFrame
    documents: pl.DataFrame
    generations: pl.DataFrame
    contrasts: pl.DataFrame | None = None
    summary: str = ""
    budget_sweep: pl.DataFrame | None = None
    files: dict[str, Path] = field(default_factory=dict)


class _PromptProgress:
    """The ``progress`` of :func:`kvdiverge.engine.rollout_job.trajectory_tables`: each
    finished prompt, named by the user's id or line, and every decode step (``on_step``) go to
    a :class:`kvdiverge.pipeline.progress.RolloutProgress` (bars on a terminal, else plain
    lines with rate and ETA); ``bar`` None: silent."""

    def __init__(self, keys: pl.DataFrame, bar: Any) -> None:
        self.names = [
            f"id {user_id!r}" if user_id is not None else line
            for user_id, line in keys.select("user_id", "line").rows()
        ]
        self.bar, self.done = bar, 0
        self.on_step = None if bar is None else bar.on_step

    def update(self, n: int = 1) -> None:
        for _ in range(n):
            self.done += 1
            if self.bar is not None:
                name = self.names[self.done - 1] if self.done <= len(self.names) else None
                self.bar.document(f"prompt {name}" if name else None)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _stderr_line(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def planned_files(
    actions: Sequence[LabelledAction], baseline: str | None, sweep: bool = False
) -> list[str]:
    """Every file :func:`compare` writes, relative to its folder."""
    files = ["documents.parquet", "estimands.csv", "estimands.md"]
    files += [f"trajectories/{a.file_stem}.parquet" for a in actions]
    files += [f"table1.{e}" for e in _TABLE_FORMATS]
    files += ["fig5_divergence_cdf.png", "fig5_divergence_cdf.pdf", "accuracy.csv"]
    files += [f"table_accuracy.{e}" for e in _TABLE_FORMATS]
    files += ["accuracy.png", "accuracy.pdf", "generations.parquet", "generations.html"]
    files += ["metrics.json", "cache_bytes.csv", "cache_bytes.md"]
    if baseline is not None:
        files += ["contrasts.csv", "contrasts.md", "summary.md"]
        files += ["contrasts.png", "contrasts.pdf", "decomposition.png", "decomposition.pdf"]
    if sweep:
        files += ["budget_sweep.csv", "budget_sweep.png", "budget_sweep.pdf"]
    if sweep and baseline is not None:
        files += ["budget_contrasts.csv", "budget_contrasts.md"]
    return files


def _write_cache_bytes(
    actions: Sequence[LabelledAction],
    held: dict[str, dict],
    frames: dict[str, pl.DataFrame],
    lm: Any,
    H: int,
    root: Path,
) -> None:
    """``cache_bytes.csv`` and ``.md``: each action's cache bytes beside its budget and as a
    share of the full cache on the same prompts (:mod:`kvdiverge.analysis.cache_bytes`)."""
    from kvdiverge.analysis.cache_bytes import (
        cache_bytes_markdown,
        cache_bytes_table,
        full_cache_bytes,
    )
    from kvdiverge.io import atomic_path, atomic_write_text

    config = lm.config
    heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    shape = (config.num_hidden_layers, n_kv, head_dim, lm.dtype.itemsize)
    lengths: dict[str, int] = {}
    for frame in frames.values():
        for doc_id, n in frame.select("doc_id", "n_prompt").unique().iter_rows():
            lengths[doc_id] = int(n)
    full = {d: full_cache_bytes(n, H, *shape) for d, n in lengths.items()}
    specs = {a.label: (a.action.as_dict(), held.get(a.label, {})) for a in actions}
    table = cache_bytes_table(specs, full)
    with atomic_path(root / "cache_bytes.csv") as tmp:
        table.write_csv(tmp)
    atomic_write_text(root / "cache_bytes.md", cache_bytes_markdown(table))


def _write_trajectories(
    frames: dict[str, pl.DataFrame],
    actions: Sequence[LabelledAction],
    folder: Path,
    metadata: dict[str, Any],
    held: dict[str, dict] | None = None,
) -> dict[str, list[Path]]:
    """Each action's trajectory file ``folder/trajectories/<escaped label>.parquet`` with the
    contract's metadata (:mod:`kvdiverge.io.trajectories`), its label and spec text, and the
    cache bytes ``held`` of each document (``docs/engine.md``, "Cache bytes")."""
    from kvdiverge.io.trajectories import write_trajectories

    paths = {}
    for a in actions:
        path = folder / "trajectories" / f"{a.file_stem}.parquet"
        meta = metadata | {
            "action": a.action.as_dict(),
            "label": a.label,
            "spec": a.spec,
            "n_documents": frames[a.label]["doc_id"].n_unique(),
        }
        if held is not None:
            documents = held.get(a.label, {})
            meta["cache_bytes"] = {"unit": "bytes", "per": "layer", "documents": documents}
        write_trajectories(frames[a.label], path, meta)
        paths[a.label] = [path]
    return paths


def compare(
    model: str | os.PathLike,
    prompts: str | os.PathLike | Sequence[dict] | Any,
    actions: str | Sequence[str],
    *,
    baseline: str | None = None,
    budgets: str | Sequence[float | int] | None = None,
    K: int = 4,
    H: int = 32,
    temperature: float = 1.0,
    out: str | os.PathLike | None = None,
    force: bool = False,
    seed: int = 0,
    draws: int = 1000,
    level: float = 0.95,
    metric: str = "substring_match",
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    max_batch_rows: int = 192,
    log: Callable[[str], None] | None = None,
    quiet: bool = False,
    tasks: str | Sequence[str] | None = None,
    context: int | None = None,
    limit: int | None = None,
) -> CompareResult:
    """Run a small study of ``actions`` on ``prompts`` with ``model`` (module docstring).

    ``model``: a local model folder or a hub id in the cache; ``prompts``: a ``.jsonl`` or
    ``.parquet`` file of records (``prompt``, ``answers``, optional ``id``, ``task``,
    ``context``), or a list of such records or a DataFrame of them; ``actions``: ``"a,b"`` or a
    list of items (:func:`kvdiverge.compare.actions.parse_actions`); ``baseline``: the label of
    one of them, or an action item of its own, that every other action is contrasted against
    (``contrasts.csv``, ``summary.md``); ``budgets``: a paired grid, each action with a budget,
    the baseline too, run at every budget given (``0.25,0.5,0.75``; labels ``LABEL@b``) and
    contrasted with the baseline at its own budget, with ``budget_sweep.{csv,png,pdf}`` and
    ``budget_contrasts.{csv,md}``; ``K`` replicates per prompt and action; ``H`` generated
    tokens; ``temperature``: the decoding temperature (0: greedy, and K = 1 since every
    replicate is the same path); ``out`` (optional) the folder for the files, new or empty
    unless ``force`` (which replaces only what an earlier compare wrote there:
    :mod:`kvdiverge.compare.folder`); ``metric``: the accuracy metric
    (:data:`kvdiverge.datasets.scoring.METRICS`). Every input is checked before the model loads
    (those that need no tokenizer before torch and transformers are imported); each failure is
    one :class:`CompareError` line, and nothing is written. Messages and live progress (by
    prompt and by decode step, with rate and ETA) go to stderr, or to ``log`` (one line per
    call, never a carriage return) when given; ``quiet``: neither. ``tasks`` (with ``prompts``
    None): named task suites instead of a prompts file, ``ruler:niah_single_1,ruler:vt``, fitted
    to ``context`` tokens, ``limit`` documents per task, each scored by its suite's metric
    (:mod:`kvdiverge.compare.tasks`).

    Files in ``out``: :func:`planned_files`.
    """
    from kvdiverge.datasets.scoring import METRICS

    say = (lambda message: None) if quiet else (log or _stderr_line)
    check_numbers(K, H, draws, level, temperature)
    if metric not in METRICS:
        raise CompareError(f"--metric: expected one of {', '.join(METRICS)}, got {metric!r}")
    suite = _check_source(prompts, tasks, context, limit, H)
    swept_budgets = parse_budgets(budgets)
    labelled, base = with_baseline(parse_actions(actions), baseline)
    if base is not None and len(labelled) < 2:
        raise CompareError(f"--baseline: {base!r} is the only action; add --actions to compare")
    method = baseline_method(labelled, base)
    labelled, sweep = sweep_budgets(labelled, swept_budgets, base)
    if budgets is not None and not any(m != method for m, _ in sweep.values()):
        raise CompareError(
            "--budgets: no action to sweep (every action keeps everything or is the baseline)"
        )
    pairs = contrast_pairs(labelled, base, sweep, method)
    if base is not None and not pairs:
        raise CompareError("--baseline: no action to contrast with it at the swept budgets")
    names = [a.label for a in labelled]
    planned = planned_files(labelled, base, bool(sweep))
    root = None if out is None else check_out(out, planned, force)
    # every check above needs no model; the model's own checks import torch and transformers
    from kvdiverge.engine.preflight import check_documents, check_model_source
    from kvdiverge.models import chat_prompt_ids, load_tokenizer

    spec = {"path": str(model), "trust_remote_code": trust_remote_code}
    try:
        info = check_model_source(spec, "--model")
    except ValueError as exc:
        raise CompareError(str(exc)) from None
    try:  # the tokenizer's template, ids and EOS against the folder (kvdiverge.models.checks)
        tokenizer = load_tokenizer(str(model), trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise CompareError(f"--model: {' '.join(str(exc).split())}") from None

    def length_fn(prompt: str) -> int:
        return len(chat_prompt_ids(tokenizer, prompt))

    max_positions = info.get("max_positions") if info else None
    if suite is not None:
        n = 12 if limit is None else limit
        documents, metric_of = task_documents(
            suite, context, n, H, length_fn, seed, f"{Path(str(model)).name}'s chat template"
        )
        keys, source = task_keys(documents), f"--tasks {suite.text}"
    else:
        documents, keys, source = user_documents(prompts, H, metric, length_fn)
        metric_of = None
    lengths = documents["n_tokens"].to_list()
    shown = [name_user_prompt(f"doc_id {d!r}", keys) for d in documents["doc_id"].to_list()]
    swept = [a for a in labelled if a.label in sweep]
    check_budget_lengths(swept, lengths, shown, "--budgets")
    check_budget_lengths([a for a in labelled if a.label not in sweep], lengths, shown,
                         "--actions")  # fmt: skip
    if temperature != 0 and (problem := replicates_problem(K, H, documents.height)):
        raise CompareError(problem)
    try:
        specs = {a.label: a.action for a in labelled}
        # actions_field None: compare's own fix below, in --actions' spelling
        check_documents(documents, specs, max_positions, H, str(source), actions_field=None)
    except ValueError as exc:
        message = name_user_prompt(str(exc), keys)
        culprit = next((a for a in labelled if f"action {a.label!r}" in message), None)
        if culprit is not None and "observation window" in message:
            message += window_hint(culprit, lengths)
        raise CompareError(message) from None
    if temperature == 0 and K > 1:
        say(f"temperature 0 (greedy): every replicate is the same path, so K = 1 (not {K})")
        K = 1
    prompts = source
    say(
        f"{documents.height} prompts from {prompts}; actions {', '.join(names)}"
        + (f" (baseline {base})" if base else "")
        + f"; K={K}, H={H}, temperature {temperature:g}"
    )
    progress = None
    if not quiet:
        progress = RolloutProgress(documents.height, write=log, unit="prompt")
    return _run(
        model, prompts, labelled, base, sweep, pairs, documents, keys, tokenizer, root, progress,
        K=K, H=H, temperature=temperature, seed=seed, draws=draws, level=level, metric=metric,
        device=device, dtype=dtype, trust_remote_code=trust_remote_code,
        max_batch_rows=max_batch_rows, say=say, metric_of=metric_of,
    )  # fmt: skip


def _check_source(
    prompts: Any, tasks: Any, context: int | None, limit: int | None, H: int
) -> TaskSuite | None:
    """Exactly one of ``prompts`` and ``tasks``, checked without a model: the prompts' records
    (a bad one is one line before torch is imported), or the task suites with ``context``
    and ``limit``; returns the suites (None for prompts)."""
    if tasks is None:
        if prompts is None:
            raise CompareError("--prompts: expected a prompts file (or --tasks SUITE:TASK,...)")
        if context is not None or limit is not None:
            raise CompareError("--context and --limit go with --tasks, not with --prompts")
        check_prompt_records(prompts)
        return None
    if prompts is not None:
        raise CompareError("--tasks: expected either --prompts or --tasks, not both")
    if context is None:
        raise CompareError("--tasks: expected --context TOKENS (the prompt plus H tokens)")
    suite = parse_tasks(tasks)
    check_task_numbers(context, 12 if limit is None else limit, H)
    return suite


def _run(
    model: str | os.PathLike,
    prompts: Path | str,
    labelled: list[LabelledAction],
    base: str | None,
    sweep: dict[str, tuple[str, float | int]],
    pairs: dict[str, str],
    documents: pl.DataFrame,
    keys: pl.DataFrame,
    tokenizer: Any,
    root: Path | None,
    bar: Any,
    *,
    K: int,
    H: int,
    temperature: float,
    seed: int,
    draws: int,
    level: float,
    metric: str,
    device: str,
    dtype: str,
    trust_remote_code: bool,
    max_batch_rows: int,
    say: Callable[[str], None],
    metric_of: Callable[[str, str], str] | None = None,
) -> CompareResult:
    """The rollouts, the analysis and the files of :func:`compare`, once every input is checked."""
    from kvdiverge.analysis.accuracy import (
        accuracy_document_stats,
        accuracy_table,
        document_metrics,
        timing_depth,
        write_accuracy,
    )
    from kvdiverge.analysis.document_stats import document_stats
    from kvdiverge.analysis.estimands import all_pairs, estimands_table, write_estimands
    from kvdiverge.compare.contrasts import baseline_contrasts, write_contrast_outputs
    from kvdiverge.compare.sweep import (
        budget_contrast_table,
        kv_bytes_per_entry,
        sweep_table,
        write_budget_contrasts,
        write_sweep,
    )
    from kvdiverge.datasets import write_documents
    from kvdiverge.engine.families import UnsupportedAttentionError, check_loaded_attention
    from kvdiverge.engine.rollout_job import trajectory_tables
    from kvdiverge.engine.settings import RolloutSettings
    from kvdiverge.eviction import ActionError
    from kvdiverge.models import DeviceError, eos_token_ids, load_model
    from kvdiverge.models.checks import model_vocab_size
    from kvdiverge.plots.accuracy import write_accuracy_figure
    from kvdiverge.plots.base import save_figure
    from kvdiverge.plots.study import action_styles, plot_divergence_cdf
    from kvdiverge.tables import (
        accuracy_study_table,
        table1_timing,
        write_accuracy_table,
        write_table,
    )
    from kvdiverge.tables.generations import generations_table, write_generations
    from kvdiverge.tables.headline import headline_table, render_headline_markdown
    from kvdiverge.tables.metrics import write_metrics

    names = [a.label for a in labelled]
    specs = [a.action for a in labelled]
    start = time.perf_counter()
    with quiet_library_bars():  # no "Loading weights" bar written into a file
        try:
            lm = load_model(str(model), device=device, dtype=dtype,
                            trust_remote_code=trust_remote_code)  # fmt: skip
        except DeviceError as exc:  # no GPU where one was asked for or promised
            raise CompareError(str(exc)) from None
    try:  # the arguments the model passes its attention (docs/models.md, "Model families")
        check_loaded_attention(lm, "--model", int(documents["n_tokens"].max()) + H)
    except UnsupportedAttentionError as exc:
        raise CompareError(str(exc)) from None
    say(f"model loaded: {time.perf_counter() - start:.1f} s")
    eos = eos_token_ids(lm, tokenizer)
    settings = RolloutSettings(
        H=H, seed=seed, max_batch_rows=max_batch_rows, temperature=temperature
    )
    jobs = [(d, p, dict.fromkeys(names, K)) for d, p in documents.select("doc_id", "prompt").rows()]
    progress = _PromptProgress(keys, bar)
    try:
        held: dict[str, dict] = {}  # each action's cache bytes per document
        frames = trajectory_tables(
            lm, tokenizer, jobs, specs, eos, settings, progress, on_step=progress.on_step,
            cache_bytes=held,
        )  # fmt: skip
    except UnsupportedAttentionError as exc:  # docs/models.md, "Model families"
        raise CompareError(str(exc)) from None
    except ActionError as exc:  # a selector broke its contract (kvdiverge.eviction.contract)
        raise CompareError(str(exc)) from exc
    finally:
        progress.close()
    say(
        f"rollouts of {len(jobs)} prompts x {len(names)} actions: "
        f"{time.perf_counter() - start:.1f} s"
    )

    metadata = {
        "study": STUDY,
        "model": {"name": Path(str(model)).name, "path": str(model)},
        "revision": None,
        "H": H,
        "K": {COHORT: K},
        "seed": seed,
        "coupling": settings.coupling,
        "temperature": temperature,
        "dtype": str(lm.dtype).removeprefix("torch."),
        "device": str(lm.device),
        "eos_ids": list(eos),
        "vocab_size": model_vocab_size(lm),  # every token id lies below it (kvdiverge.io.roles)
    }
    files: dict[str, Path] = {}
    planned = planned_files(labelled, base, bool(sweep))
    if root is not None:
        claim_out(root, planned)
    with tempfile.TemporaryDirectory(prefix="kvdiverge-compare-") as scratch:
        work = root if root is not None else Path(scratch)
        traj_paths = _write_trajectories(frames, labelled, work, metadata, held)
        role = {"study": STUDY, "model": Path(str(model)).name}
        cohorts = {str(p): COHORT for paths in traj_paths.values() for p in paths}
        stats, clock = document_stats(traj_paths, documents, role=role, cohorts=cohorts)
    if root is not None:
        files |= {f"trajectories/{a}": paths[0] for a, paths in traj_paths.items()}
    model_name = Path(str(model)).name
    contrasts = list(pairs.items()) if base else all_pairs(names)
    estimands = estimands_table(
        stats,
        clock,
        model=model_name,
        actions=names,
        contrasts=contrasts,
        draws=draws,
        seed=seed,
        level=level,
    )
    table1 = table1_timing(estimands, names, "estimands")
    cdf = (
        estimands.filter(
            (pl.col("stratum") == "pooled")
            & (pl.col("contrast") == "")
            & pl.col("estimand").str.starts_with("div_cdf@")
        )
        .with_columns(t=pl.col("estimand").str.split("@").list.get(1).cast(pl.Int64))
        .select("action", "t", "value", "ci_low", "ci_high", "ci_level", "n_docs")
        .sort("action", "t")
    )
    with_metrics = document_metrics(documents, metric_of or (lambda stratum, task: metric))
    depth = timing_depth(H)
    acc_stats = accuracy_document_stats(
        {a: [frames[a]] for a in names}, with_metrics, tokenizer, depth
    )
    accuracy = accuracy_table(
        acc_stats, model=model_name, actions=names, draws=draws, seed=seed, level=level
    )
    acc_table = accuracy_study_table(accuracy, names)
    generations = generations_table(frames, names, with_metrics, keys, tokenizer, depth)
    swept = sweep_table(estimands, sweep) if sweep else None
    table, summary = (None, "")
    if base is not None:
        table, summary = baseline_contrasts(
            estimands, stats, acc_stats, names, pairs, H=H, metric=metric_name(with_metrics),
            draws=draws, seed=seed, level=level, temperature=temperature,
        )  # fmt: skip
        head = render_headline_markdown(headline_table(estimands, accuracy, names))
        summary = f"# Each action\n\n{head}\n{summary}"
    by_budget = None
    if sweep and table is not None:
        kept = {a: float(f.group_by("doc_id").agg(pl.col("n_kept").first())["n_kept"].mean())
                for a, f in frames.items() if f.height}  # fmt: skip
        per_entry = kv_bytes_per_entry(lm.config, lm.dtype.itemsize)
        by_budget = budget_contrast_table(table, sweep, kept, per_entry)
    if root is not None:
        write_documents(documents, root / "documents.parquet", metadata={"prompts": str(prompts)})
        write_estimands(estimands, root / "estimands.csv", root / "estimands.md")
        write_table(table1, *(root / f"table1.{e}" for e in _TABLE_FORMATS))
        styles = action_styles(names)
        save_figure(
            plot_divergence_cdf(estimands, names, styles),
            root / "fig5_divergence_cdf.png",
            root / "fig5_divergence_cdf.pdf",
        )
        write_accuracy(accuracy, root / "accuracy.csv")
        tabled = tuple(root / f"table_accuracy.{e}" for e in _TABLE_FORMATS)
        write_accuracy_table(root / "accuracy.csv", tabled, names)
        write_accuracy_figure(root / "accuracy.csv", root / "accuracy.png", root / "accuracy.pdf")
        write_generations(
            generations,
            root / "generations.parquet",
            root / "generations.html",
            documents,
            tokenizer,
        )
        if table is not None:
            write_contrast_outputs(table, summary, estimands, names, pairs, root)
        if swept is not None:
            base_method = next((sweep[b][0] for b in pairs.values() if b in sweep), None)
            write_sweep(swept, estimands, base, root, baseline_method=base_method)
        if by_budget is not None:
            write_budget_contrasts(by_budget, root)
        record = folder_metrics(
            root.name, model_name, labelled, pairs, estimands, table, accuracy, documents,
            K=K, H=H, temperature=temperature, seed=seed, draws=draws, level=level,
            metric=metric, metadata=metadata, max_batch_rows=max_batch_rows,
        )  # fmt: skip
        write_metrics(record, root / "metrics.json")
        _write_cache_bytes(labelled, held, frames, lm, H, root)
        finish_out(root, planned)
        files |= {p: root / p for p in planned if not p.startswith("trajectories/")}
        say(f"wrote {root}")
    return CompareResult(
        estimands=estimands,
        table1=table1.data,
        divergence_cdf=cdf,
        accuracy=accuracy,
        accuracy_table=acc_table.data,
        documents=documents,
        generations=generations,
        contrasts=table,
        summary=summary,
        budget_sweep=swept,
        files=files,
    )
