"""A small study without Snakemake: one model, one prompts file, a few actions.

:func:`compare` runs the pipeline's own steps in one process, in the order the workflow runs
them: the prompts become a ``custom`` stratum's documents (:mod:`kvdiverge.datasets.custom`,
prompts as given), the model and every document are checked before the model loads
(:mod:`kvdiverge.engine.preflight`), the coupled rollouts run through
:func:`kvdiverge.engine.rollout_job.rollout_documents_actions` and are written as trajectory
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
"""

from __future__ import annotations

import os
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
    parse_actions,
    parse_budgets,
    sweep_budgets,
    with_baseline,
)
from kvdiverge.compare.folder import check_out, claim_out, finish_out

__all__ = ["CompareResult", "compare", "planned_files"]

STRATUM_LABEL = "prompts"
"""Label of the one ``custom`` stratum the prompts form (documents ``custom-prompts/...``)."""
COHORT = "study1"

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


def _check_numbers(K: int, H: int, draws: int, level: float, temperature: float) -> None:
    if not isinstance(K, int) or isinstance(K, bool) or K < 1:
        raise CompareError(f"--K: expected an integer >= 1, got {K!r}")
    if not isinstance(H, int) or isinstance(H, bool) or H < 4:
        raise CompareError(f"--H: expected an integer >= 4 (the analysis clock), got {H!r}")
    if not isinstance(draws, int) or isinstance(draws, bool) or draws < 1:
        raise CompareError(f"--draws: expected an integer >= 1, got {draws!r}")
    if not isinstance(level, float | int) or not 0 < level < 1:
        raise CompareError(f"--level: expected a number in (0, 1), got {level!r}")
    ok = isinstance(temperature, float | int) and not isinstance(temperature, bool)
    if not ok or not 0 <= temperature < float("inf"):
        raise CompareError(
            f"--temperature: expected a finite number >= 0 (0: greedy), got {temperature!r}"
        )


def _documents(
    prompts: Path, H: int, metric: str, length_fn: Callable
) -> tuple[pl.DataFrame, list]:
    """The prompts as a custom stratum's documents (all in cohort study1), as given, and the
    records they came from (the same order); lengths are checked by the caller."""
    from kvdiverge.datasets import DatasetError, DatasetsConfig, materialize_stratum
    from kvdiverge.datasets.custom import read_custom_records

    try:
        records = read_custom_records(prompts)
    except DatasetError as exc:
        raise CompareError(str(exc)) from None
    section = {
        "seed": 0,
        "length_tokenizer": "compare",
        "generation_reserve": H,
        "cohorts": {"dev": 0, COHORT: len(records), "study2": 0},
        "strata": [
            {
                "env": "custom",
                "label": STRATUM_LABEL,
                "target_tokens": 2**62,  # unbounded here: the model's window is checked after
                "path": str(prompts),
                "metric": metric,
            }
        ],
    }
    try:
        cfg = DatasetsConfig.from_config(section)
        documents = materialize_stratum(cfg, cfg.strata[0].name, length_fn)
    except DatasetError as exc:
        raise CompareError(str(exc)) from None
    return documents, records


def _user_keys(documents: pl.DataFrame, records: Sequence, prompts: Path) -> pl.DataFrame:
    """doc_id → the user's ``id`` (null when the record has none) and ``line`` (``line 3`` of a
    JSONL file, ``row 3`` of a Parquet file), checked against each document's source."""
    keys = []
    for doc_id, source in documents.select("doc_id", "source").rows():
        index = int(doc_id.rsplit("/", 1)[1])
        record = records[index]
        line = record.where.rsplit(", ", 1)[1]
        label = record.id if record.id is not None else line
        expected = f"custom:{prompts}#{label}"
        if source != expected and not source.startswith(expected + " "):
            raise CompareError(f"{prompts}: document {doc_id!r} does not match {record.where}")
        keys.append({"doc_id": doc_id, "user_id": record.id, "line": line})
    return pl.DataFrame(keys, schema={"doc_id": pl.String, "user_id": pl.String, "line": pl.String})


def _name_user_prompt(message: str, keys: pl.DataFrame) -> str:
    """A preflight message with the generated doc_id replaced by the user's id and line."""
    for doc_id, user_id, line in keys.rows():
        named = f"prompt {user_id!r} ({line})" if user_id is not None else f"the prompt of {line}"
        message = message.replace(f"doc_id {doc_id!r}", named)
    return message


class _PromptProgress:
    """One log line per finished prompt, with the user's id or line and the elapsed time (the
    ``progress`` of :func:`kvdiverge.engine.rollout_job.rollout_documents_actions`)."""

    def __init__(self, keys: pl.DataFrame, say: Callable[[str], None], start: float) -> None:
        self.names = [
            f"id {user_id!r}" if user_id is not None else line
            for user_id, line in keys.select("user_id", "line").rows()
        ]
        self.say, self.start, self.done = say, start, 0

    def update(self, n: int = 1) -> None:
        for _ in range(n):
            self.done += 1
            name = self.names[self.done - 1] if self.done <= len(self.names) else "?"
            elapsed = time.perf_counter() - self.start
            self.say(f"prompt {self.done}/{len(self.names)} ({name}) done: {elapsed:.1f} s")


def _prompts_file(prompts: Any, scratch: Path) -> Path:
    """``prompts`` as a file: a path as given, or a list of records (dicts) or a polars / pandas
    DataFrame written as JSONL into ``scratch`` (then ``line N`` names record N)."""
    import json

    if isinstance(prompts, str | os.PathLike):
        return Path(prompts)
    if hasattr(prompts, "to_dicts"):  # polars
        records = prompts.to_dicts()
    elif hasattr(prompts, "to_dict") and hasattr(prompts, "columns"):  # pandas
        records = prompts.to_dict(orient="records")
    elif isinstance(prompts, Sequence) and all(isinstance(r, dict) for r in prompts):
        records = list(prompts)
    else:
        raise CompareError(
            "prompts: expected a .jsonl or .parquet path, a list of records (dicts with prompt, "
            f"answers, optional id, task, context) or a DataFrame of them, got "
            f"{type(prompts).__name__}"
        )
    path = scratch / "prompts.jsonl"
    try:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    except TypeError as exc:
        raise CompareError(f"prompts: a record is not JSON data ({exc})") from None
    return path


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
    if baseline is not None:
        files += ["contrasts.csv", "contrasts.md", "summary.md"]
        files += ["contrasts.png", "contrasts.pdf", "decomposition.png", "decomposition.pdf"]
    if sweep:
        files += ["budget_sweep.csv", "budget_sweep.png", "budget_sweep.pdf"]
    return files


def _write_trajectories(
    frames: dict[str, pl.DataFrame],
    actions: Sequence[LabelledAction],
    folder: Path,
    metadata: dict[str, Any],
) -> dict[str, list[Path]]:
    """Each action's trajectory file ``folder/trajectories/<escaped label>.parquet`` with the
    contract's metadata (:mod:`kvdiverge.io.trajectories`), its label and spec text."""
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
) -> CompareResult:
    """Run a small study of ``actions`` on ``prompts`` with ``model`` (module docstring).

    ``model``: a local model folder or a hub id in the cache; ``prompts``: a ``.jsonl`` or
    ``.parquet`` file of records (``prompt``, ``answers``, optional ``id``, ``task``, ``context``),
    or a list of such records or a DataFrame of them;
    ``actions``: ``"a,b"`` or a list of items (:func:`kvdiverge.compare.actions.parse_actions`);
    ``baseline``: the label of one of them, or an action item of its own, that every other action
    is contrasted against (``contrasts.csv``, ``summary.md``); ``budgets``: a sweep, each action
    with a budget (not the baseline) run at every budget given (``0.25,0.5,0.75``; labels
    ``LABEL@b``), with ``budget_sweep.{csv,png,pdf}``; ``K`` replicates per prompt and
    action; ``H`` generated tokens; ``temperature``: the decoding temperature (0: greedy, and
    K = 1 since every replicate is the same path); ``out`` (optional) the folder for the files,
    new or empty unless ``force`` (which replaces only what an earlier compare wrote there:
    :mod:`kvdiverge.compare.folder`); ``metric``: the accuracy metric
    (:data:`kvdiverge.datasets.scoring.METRICS`). Every input is checked before the model
    loads; each failure is one :class:`CompareError` line, and nothing is written.

    Files in ``out``: :func:`planned_files`.
    """
    from kvdiverge.datasets.scoring import METRICS
    from kvdiverge.engine.preflight import check_documents, check_model_source
    from kvdiverge.models import chat_prompt_ids, load_tokenizer

    say = log or (lambda message: None)
    _check_numbers(K, H, draws, level, temperature)
    if metric not in METRICS:
        raise CompareError(f"--metric: expected one of {', '.join(METRICS)}, got {metric!r}")
    labelled, base = with_baseline(parse_actions(actions), baseline)
    if base is not None and len(labelled) < 2:
        raise CompareError(f"--baseline: {base!r} is the only action; add --actions to compare")
    labelled, sweep = sweep_budgets(labelled, parse_budgets(budgets), base)
    if budgets is not None and not sweep:
        raise CompareError(
            "--budgets: no action to sweep (every action keeps everything or is the baseline)"
        )
    names = [a.label for a in labelled]
    planned = planned_files(labelled, base, bool(sweep))
    root = None if out is None else check_out(out, planned, force)
    spec = {"path": str(model), "trust_remote_code": trust_remote_code}
    try:
        info = check_model_source(spec, "--model")
    except ValueError as exc:
        raise CompareError(str(exc)) from None
    tokenizer = load_tokenizer(str(model), trust_remote_code=trust_remote_code)

    def length_fn(prompt: str) -> int:
        return len(chat_prompt_ids(tokenizer, prompt))

    max_positions = info.get("max_positions") if info else None
    with tempfile.TemporaryDirectory(prefix="kvdiverge-prompts-") as scratch:
        path = _prompts_file(prompts, Path(scratch))
        try:
            documents, records = _documents(path, H, metric, length_fn)
        except CompareError as exc:
            if isinstance(prompts, str | os.PathLike):
                raise
            message = str(exc).replace(f"{path}, line ", "prompts, record ")
            raise CompareError(message.replace(str(path), "prompts")) from None
        keys = _user_keys(documents, records, path)
    source = path if isinstance(prompts, str | os.PathLike) else "the records given"
    try:
        check_documents(
            documents, {a.label: a.action for a in labelled}, max_positions, H, str(source)
        )
    except ValueError as exc:
        raise CompareError(_name_user_prompt(str(exc), keys)) from None
    if temperature == 0 and K > 1:
        say(f"temperature 0 (greedy): every replicate is the same path, so K = 1 (not {K})")
        K = 1
    prompts = source
    say(
        f"{documents.height} prompts from {prompts}; actions {', '.join(names)}"
        + (f" (baseline {base})" if base else "")
        + f"; K={K}, H={H}, temperature {temperature:g}"
    )
    return _run(
        model, prompts, labelled, base, sweep, documents, keys, tokenizer, root,
        K=K, H=H, temperature=temperature, seed=seed, draws=draws, level=level, metric=metric,
        device=device, dtype=dtype, trust_remote_code=trust_remote_code,
        max_batch_rows=max_batch_rows, say=say,
    )  # fmt: skip


def _run(
    model: str | os.PathLike,
    prompts: Path | str,
    labelled: list[LabelledAction],
    base: str | None,
    sweep: dict[str, tuple[str, float | int]],
    documents: pl.DataFrame,
    keys: pl.DataFrame,
    tokenizer: Any,
    root: Path | None,
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
    from kvdiverge.compare.sweep import sweep_table, write_sweep
    from kvdiverge.datasets import write_documents
    from kvdiverge.engine.rollout_job import rollout_documents_actions
    from kvdiverge.engine.settings import RolloutSettings
    from kvdiverge.eviction import ActionError
    from kvdiverge.models import eos_token_ids, load_model
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

    names = [a.label for a in labelled]
    specs = [a.action for a in labelled]
    start = time.perf_counter()
    lm = load_model(str(model), device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    say(f"model loaded: {time.perf_counter() - start:.1f} s")
    eos = eos_token_ids(lm, tokenizer)
    settings = RolloutSettings(
        H=H, seed=seed, max_batch_rows=max_batch_rows, temperature=temperature
    )
    jobs = [(d, p, dict.fromkeys(names, K)) for d, p in documents.select("doc_id", "prompt").rows()]
    progress = _PromptProgress(keys, say, time.perf_counter())
    try:
        frames = rollout_documents_actions(lm, tokenizer, jobs, specs, eos, settings, progress)
    except ActionError as exc:  # a selector broke its contract (kvdiverge.eviction.contract)
        raise CompareError(str(exc)) from exc
    say(
        f"rollouts of {len(jobs)} prompts x {len(names)} actions: "
        f"{time.perf_counter() - start:.1f} s"
    )

    metadata = {
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
    }
    files: dict[str, Path] = {}
    planned = planned_files(labelled, base, bool(sweep))
    if root is not None:
        claim_out(root, planned)
    with tempfile.TemporaryDirectory(prefix="kvdiverge-compare-") as scratch:
        work = root if root is not None else Path(scratch)
        traj_paths = _write_trajectories(frames, labelled, work, metadata)
        stats, clock = document_stats(traj_paths, documents)
    if root is not None:
        files |= {f"trajectories/{a}": paths[0] for a, paths in traj_paths.items()}
    model_name = Path(str(model)).name
    contrasts = [(a, base) for a in names if a != base] if base else all_pairs(names)
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
    with_metrics = document_metrics(documents, lambda stratum, task: metric)
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
            estimands, stats, acc_stats, names, base, H=H, metric=metric,
            draws=draws, seed=seed, level=level, temperature=temperature,
        )  # fmt: skip
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
            write_contrast_outputs(table, summary, estimands, names, base, root)
        if swept is not None:
            write_sweep(swept, estimands, base, root)
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
