"""A small study without Snakemake: one model, one prompts file, a few actions.

:func:`compare` runs the pipeline's own steps in one process, in the order the workflow runs
them: the prompts become a ``custom`` stratum's documents (:mod:`kvdiverge.datasets.custom`,
prompts as given), the model and every document are checked before the model loads
(:mod:`kvdiverge.engine.preflight`), the coupled rollouts run through
:func:`kvdiverge.engine.rollout_job.rollout_documents_actions` and are written as trajectory files,
the
document statistics, estimands and accuracy follow (:mod:`kvdiverge.analysis`), and Table 1, the
figure-5 divergence CDF and the accuracy table and figure are written into one folder
(:mod:`kvdiverge.tables`, :mod:`kvdiverge.plots`). It returns the tables as polars frames.

Actions are named on the command line as ``SELECTOR[@BUDGET][+KEY=VALUE]...``
(:func:`parse_action_list`): ``snapkv@0.5``, ``recent@512``, ``full``,
``snapkv@0.5+window=16``, ``kvpress@0.5+press=KnormPress`` or ``package.module:Class@0.5``
— the ``selector``, ``budget`` and parameters of a config's action entry
(:func:`kvdiverge.eviction.parse_action`); the text is the action's name.
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
import yaml

from kvdiverge.eviction import ActionError, ActionSpec, parse_action

__all__ = ["CompareError", "CompareResult", "compare", "parse_action_list"]

STRATUM_LABEL = "prompts"
"""Label of the one ``custom`` stratum the prompts form (documents ``custom-prompts/...``)."""
COHORT = "study1"


class CompareError(ValueError):
    """A bad input of :func:`compare` (one line naming the option or file)."""


@dataclass
class CompareResult:
    """What :func:`compare` computed: the long estimands and accuracy tables, Table 1 and the
    accuracy table (their CSV frames), the pooled divergence CDF (action, t, value, interval),
    the documents, every path's decoded X and Y texts with their scores and divergence timing
    (``generations``), and the paths written (by name)."""

    estimands: pl.DataFrame
    table1: pl.DataFrame
    divergence_cdf: pl.DataFrame
    accuracy: pl.DataFrame
    accuracy_table: pl.DataFrame
    documents: pl.DataFrame
    generations: pl.DataFrame
    files: dict[str, Path] = field(default_factory=dict)


def _value(text: str) -> Any:
    """A parameter value as YAML reads it (``16`` → int, ``0.5`` → float, ``true`` → bool)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_action_list(text: str | Sequence[str]) -> list[ActionSpec]:
    """Actions from ``a,b,c`` (or a list of items), each ``SELECTOR[@BUDGET][+KEY=VALUE]...``
    (module docstring), checked by :func:`kvdiverge.eviction.parse_action`; one-line
    :class:`CompareError` naming the item."""
    items = [t.strip() for t in text.split(",")] if isinstance(text, str) else list(text)
    if not items or any(not t for t in items):
        raise CompareError(f"--actions: expected comma-separated actions, got {text!r}")
    dup = sorted({t for t in items if items.count(t) > 1})
    if dup:
        raise CompareError(f"--actions: action {dup[0]!r} given twice")
    specs = []
    for item in items:
        head, *params = item.split("+")
        selector, at, budget = head.partition("@")
        spec: dict[str, Any] = {"selector": selector}
        if at:
            spec["budget"] = _value(budget)
        for p in params:
            key, eq, value = p.partition("=")
            if not eq or not key:
                raise CompareError(f"--actions: {item!r}: expected KEY=VALUE after '+', got {p!r}")
            spec[key] = _value(value)
        try:
            specs.append(parse_action(spec, name=item))
        except ActionError as exc:
            raise CompareError(f"--actions: {exc}") from None
    return specs


def _check_numbers(K: int, H: int, draws: int, level: float) -> None:
    if not isinstance(K, int) or K < 1:
        raise CompareError(f"--K: expected an integer >= 1, got {K!r}")
    if not isinstance(H, int) or H < 4:
        raise CompareError(f"--H: expected an integer >= 4 (the analysis clock), got {H!r}")
    if not isinstance(draws, int) or draws < 1:
        raise CompareError(f"--draws: expected an integer >= 1, got {draws!r}")
    if not 0 < level < 1:
        raise CompareError(f"--level: expected a number in (0, 1), got {level!r}")


def _documents(prompts: Path, H: int, metric: str, length_fn: Callable) -> pl.DataFrame:
    """The prompts as a custom stratum's documents (all in cohort study1), as given; their
    lengths against the model's window are checked by the caller."""
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
        return materialize_stratum(cfg, cfg.strata[0].name, length_fn)
    except DatasetError as exc:
        raise CompareError(str(exc)) from None


def _write_trajectories(
    frames: dict[str, pl.DataFrame],
    specs: Sequence[ActionSpec],
    folder: Path,
    model: str | os.PathLike,
    H: int,
    K: int,
    seed: int,
    settings: Any,
    lm: Any,
    eos: Sequence[int],
) -> dict[str, list[Path]]:
    """Each action's trajectory file ``folder/trajectories/<action>.parquet`` with the
    contract's metadata (:mod:`kvdiverge.io.trajectories`)."""
    from kvdiverge.io.trajectories import write_trajectories

    paths = {}
    for a in specs:
        path = folder / "trajectories" / f"{a.name}.parquet"
        metadata = {
            "model": {"name": Path(str(model)).name, "path": str(model)},
            "revision": None,
            "action": a.as_dict(),
            "H": H,
            "K": {COHORT: K},
            "seed": seed,
            "coupling": settings.coupling,
            "dtype": str(lm.dtype).removeprefix("torch."),
            "device": str(lm.device),
            "eos_ids": list(eos),
            "n_documents": frames[a.name]["doc_id"].n_unique(),
        }
        write_trajectories(frames[a.name], path, metadata)
        paths[a.name] = [path]
    return paths


def compare(
    model: str | os.PathLike,
    prompts: str | os.PathLike,
    actions: str | Sequence[str],
    *,
    K: int = 4,
    H: int = 32,
    out: str | os.PathLike | None = None,
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
    ``.parquet`` file of records (``prompt``, ``answers``, optional ``id``, ``task``, ``context``);
    ``actions``: ``"a,b"`` or a list (:func:`parse_action_list`); ``K`` replicates per prompt
    and action; ``H`` generated tokens; ``out`` (optional) the folder for the files;
    ``metric``: the accuracy metric (:data:`kvdiverge.datasets.scoring.METRICS`). Every input is
    checked
    before the model loads; each failure is one :class:`CompareError` line.

    Files in ``out``: ``documents.parquet``, ``trajectories/<action>.parquet``,
    ``estimands.csv``, ``table1.{csv,md,tex,html}``, ``fig5_divergence_cdf.{png,pdf}``,
    ``accuracy.csv``, ``table_accuracy.{csv,md,tex,html}``, ``accuracy.{png,pdf}`` and
    ``generations.parquet`` (every path's texts, scores and divergence timing).
    """
    from kvdiverge.analysis.accuracy import (
        TIMING_CLASSES,
        accuracy_document_stats,
        accuracy_table,
        document_metrics,
        path_scores,
        timing_depth,
        write_accuracy,
    )
    from kvdiverge.analysis.document_stats import document_stats
    from kvdiverge.analysis.estimands import estimands_table, write_estimands
    from kvdiverge.datasets import write_documents
    from kvdiverge.datasets.scoring import METRICS
    from kvdiverge.engine.preflight import check_documents, check_model_source
    from kvdiverge.engine.rollout_job import rollout_documents_actions
    from kvdiverge.engine.settings import RolloutSettings
    from kvdiverge.io import atomic_path
    from kvdiverge.models import chat_prompt_ids, eos_token_ids, load_model, load_tokenizer
    from kvdiverge.plots.accuracy import write_accuracy_figure
    from kvdiverge.plots.base import save_figure
    from kvdiverge.plots.study import action_styles, plot_divergence_cdf
    from kvdiverge.tables import (
        accuracy_study_table,
        table1_timing,
        write_accuracy_table,
        write_table,
    )

    say = log or (lambda message: None)
    _check_numbers(K, H, draws, level)
    if metric not in METRICS:
        raise CompareError(f"--metric: expected one of {', '.join(METRICS)}, got {metric!r}")
    specs = parse_action_list(actions)
    names = [a.name for a in specs]
    prompts = Path(prompts)
    spec = {"path": str(model), "trust_remote_code": trust_remote_code}
    try:
        info = check_model_source(spec, "--model")
    except ValueError as exc:
        raise CompareError(str(exc)) from None
    tokenizer = load_tokenizer(str(model), trust_remote_code=trust_remote_code)

    def length_fn(prompt: str) -> int:
        return len(chat_prompt_ids(tokenizer, prompt))

    max_positions = info.get("max_positions") if info else None
    documents = _documents(prompts, H, metric, length_fn)
    try:
        check_documents(documents, {a.name: a for a in specs}, max_positions, H, str(prompts))
    except ValueError as exc:
        raise CompareError(str(exc)) from None
    root = Path(out) if out is not None else None
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
    say(f"{documents.height} prompts from {prompts}; actions {', '.join(names)}; K={K}, H={H}")

    start = time.perf_counter()
    lm = load_model(str(model), device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    eos = eos_token_ids(lm, tokenizer)
    settings = RolloutSettings(H=H, seed=seed, max_batch_rows=max_batch_rows)
    jobs = [(d, p, dict.fromkeys(names, K)) for d, p in documents.select("doc_id", "prompt").rows()]
    frames = rollout_documents_actions(lm, tokenizer, jobs, specs, eos, settings)
    say(f"rollouts: {time.perf_counter() - start:.1f} s")

    files: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="kvdiverge-compare-") as scratch:
        work = root if root is not None else Path(scratch)
        traj_paths = _write_trajectories(frames, specs, work, model, H, K, seed, settings, lm, eos)
        stats, clock = document_stats(traj_paths, documents)
    if root is not None:
        files |= {f"trajectories/{a}": paths[0] for a, paths in traj_paths.items()}
    model_name = Path(str(model)).name
    estimands = estimands_table(
        stats, clock, model=model_name, actions=names, draws=draws, seed=seed, level=level
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
    generations = pl.concat(
        [
            path_scores(frames[a], with_metrics, tokenizer, depth).with_columns(action=pl.lit(a))
            for a in names
        ]
    ).select(
        "action",
        "doc_id",
        "replicate",
        pl.col("timing").replace_strict(dict(enumerate(TIMING_CLASSES)), return_dtype=pl.String),
        "acc_x",
        "acc_y",
        "x_text",
        "y_text",
    )
    if root is not None:
        write_documents(documents, root / "documents.parquet", metadata={"prompts": str(prompts)})
        write_estimands(estimands, root / "estimands.csv", root / "estimands.md")
        write_table(table1, *(root / f"table1.{e}" for e in ("csv", "md", "tex", "html")))
        styles = action_styles(names)
        save_figure(
            plot_divergence_cdf(estimands, names, styles),
            root / "fig5_divergence_cdf.png",
            root / "fig5_divergence_cdf.pdf",
        )
        write_accuracy(accuracy, root / "accuracy.csv")
        tabled = tuple(root / f"table_accuracy.{e}" for e in ("csv", "md", "tex", "html"))
        write_accuracy_table(root / "accuracy.csv", tabled, names)
        write_accuracy_figure(root / "accuracy.csv", root / "accuracy.png", root / "accuracy.pdf")
        with atomic_path(root / "generations.parquet", suffix=".parquet") as tmp:
            generations.write_parquet(tmp)
        for name in ("documents.parquet", "estimands.csv", "table1.html", "generations.parquet"):
            files[name] = root / name
        for name in (
            "fig5_divergence_cdf.png",
            "accuracy.csv",
            "table_accuracy.html",
            "accuracy.png",
        ):
            files[name] = root / name
        say(f"wrote {root}")
    return CompareResult(
        estimands=estimands,
        table1=table1.data,
        divergence_cdf=cdf,
        accuracy=accuracy,
        accuracy_table=acc_table.data,
        documents=documents,
        generations=generations,
        files=files,
    )
