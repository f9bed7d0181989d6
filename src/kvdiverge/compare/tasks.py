"""``kvdiverge compare --tasks``: named task suites instead of a prompts file.

``--tasks ruler:niah_single_1,ruler:vt,helmet:kilt_nq --context 4096 --limit 12`` builds the
prompts with the package's own generators (:mod:`kvdiverge.datasets.ruler`,
:mod:`kvdiverge.datasets.helmet`), fitted to ``context`` tokens (the prompt plus H generated
tokens, RULER's budget rule) at the model's own chat-wrapped tokenization, ``limit`` documents
per task, each with its answers and its suite's metric (RULER's ``string_match_all``, or
``string_match_part`` for ``qa_1`` and ``qa_2``; HELMET's per dataset), so accuracy and
divergence come from one command. One stratum per suite (``ruler-<context>``,
``helmet-<context>``), cohort ``study1``; the tasks of a suite take its documents round-robin
(:func:`kvdiverge.datasets.strata.plan_documents`), so each gets ``limit``. HELMET at a
context that is not one of its standard lengths keeps the passages and documents of its
4096-token setting in proportion (at least one). The sources are the repository's fixtures
(RULER's essays, SQuAD and HotpotQA samples; HELMET's KILT and ALCE samples): a suite whose
files are absent is one line. ``--tasks list`` prints every suite and task (:func:`task_list`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from kvdiverge.compare.actions import CompareError

__all__ = [
    "SUITES",
    "TaskSuite",
    "check_task_numbers",
    "parse_tasks",
    "task_documents",
    "task_keys",
    "task_list",
]

_ROOT = Path(__file__).resolve().parents[3]
_FIXTURES = {
    "ruler": {
        "essay_dir": "data/fixtures/essays",
        "squad": "data/fixtures/squad/dev-v2.0.json",
        "hotpotqa": "data/fixtures/hotpotqa/hotpot_dev_distractor_v1.json",
    },
    "helmet": {
        "data_dir": "data/fixtures/helmet/data",
        "prompts_dir": "data/fixtures/helmet/prompts",
    },
}


def _suites() -> dict[str, tuple[str, ...]]:
    from kvdiverge.datasets.helmet import HELMET_DATASETS
    from kvdiverge.datasets.ruler import RULER_TASKS

    return {"ruler": tuple(RULER_TASKS), "helmet": tuple(HELMET_DATASETS)}


SUITES = ("ruler", "helmet")
"""The suites ``--tasks`` names, as ``SUITE:TASK``."""


class TaskSuite:
    """The tasks asked of each suite, in the order given: ``{suite: [task, ...]}``."""

    def __init__(self, tasks: dict[str, list[str]], text: str) -> None:
        self.tasks, self.text = tasks, text

    def __repr__(self) -> str:
        return f"TaskSuite({self.text!r})"


def task_list() -> str:
    """Every suite and its tasks, one suite per line (``--tasks list``)."""
    lines = [f"{suite}: {', '.join(tasks)}" for suite, tasks in _suites().items()]
    lines.append("use as --tasks SUITE:TASK[,SUITE:TASK...] --context TOKENS --limit N")
    return "\n".join(lines)


def parse_tasks(text: str | Sequence[str]) -> TaskSuite:
    """``ruler:niah_single_1,ruler:vt`` (or a list of items) as a :class:`TaskSuite`; one-line
    :class:`CompareError` naming ``--tasks`` and the item for an unknown suite or task, a
    repeated task, or a suite whose source files are absent."""
    items = [t.strip() for t in text.split(",")] if isinstance(text, str) else list(text)
    if not items or any(not isinstance(t, str) or not t.strip() for t in items):
        raise CompareError(f"--tasks: expected SUITE:TASK items, got {text!r}")
    suites = _suites()
    tasks: dict[str, list[str]] = {}
    for item in items:
        suite, colon, task = item.partition(":")
        if not colon or suite not in suites:
            raise CompareError(
                f"--tasks: {item!r}: expected SUITE:TASK with SUITE one of {', '.join(suites)} "
                "(--tasks list shows every task)"
            )
        if task not in suites[suite]:
            import difflib

            close = difflib.get_close_matches(task, suites[suite], n=1)
            hint = f"; did you mean {suite}:{close[0]}?" if close else ""
            raise CompareError(
                f"--tasks: {item!r}: {suite} has no task {task!r}; expected one of "
                f"{', '.join(suites[suite])}{hint}"
            )
        if task in tasks.get(suite, []):
            raise CompareError(f"--tasks: {item!r} given twice")
        tasks.setdefault(suite, []).append(task)
    for suite in tasks:
        missing = [p for p in _FIXTURES[suite].values() if not (_ROOT / p).exists()]
        if missing:
            raise CompareError(
                f"--tasks: {suite}'s source files are not present ({_ROOT / missing[0]}); "
                "run from a clone of the repository"
            )
    return TaskSuite(tasks, ",".join(items))


def _helmet_counts(context: int) -> dict[str, int]:
    from kvdiverge.datasets.helmet import CITE_DOCUMENTS, RAG_PASSAGES

    if context in RAG_PASSAGES:
        return {"rag_passages": RAG_PASSAGES[context], "cite_documents": CITE_DOCUMENTS[context]}
    return {
        "rag_passages": max(1, round(RAG_PASSAGES[4096] * context / 4096)),
        "cite_documents": max(1, round(CITE_DOCUMENTS[4096] * context / 4096)),
    }


def check_task_numbers(context: Any, limit: Any, H: int) -> None:
    """``context`` a token count above H, ``limit`` at least one document per task."""
    if not isinstance(context, int) or isinstance(context, bool) or context <= H:
        raise CompareError(
            f"--context: expected a token count above H = {H} (prompt plus H generated "
            f"tokens), got {context!r}"
        )
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise CompareError(f"--limit: expected an integer >= 1 documents per task, got {limit!r}")


def task_documents(
    suite: TaskSuite,
    context: int,
    limit: int,
    H: int,
    length_fn: Callable[[str], int],
    seed: int = 0,
    tokenizer_name: str = "the model's tokenizer",
) -> tuple[pl.DataFrame, Callable[[str, str], str]]:
    """The documents of ``suite`` (module docstring) fitted under ``length_fn`` (the model's
    chat-wrapped length), and ``metric_of(stratum, task)``: each document's metric."""
    from kvdiverge.datasets import DatasetError, DatasetsConfig, materialize_stratum
    from kvdiverge.datasets.registry import environment

    check_task_numbers(context, limit, H)
    frames = []
    for name, tasks in suite.tasks.items():
        stratum: dict[str, Any] = {"env": name, "label": str(context), "target_tokens": context}
        if name == "helmet":
            stratum |= _helmet_counts(context)
        fixtures = {k: str(_ROOT / v) for k, v in _FIXTURES[name].items()}
        section = {
            "seed": seed,
            "length_tokenizer": tokenizer_name,
            "generation_reserve": H,
            "cohorts": {"dev": 0, "study1": limit * len(tasks), "study2": 0},
            "strata": [stratum],
            "ruler": {"tasks": tasks if name == "ruler" else ["niah_single_1"]}
            | (fixtures if name == "ruler" else {}),
            "helmet": {"datasets": tasks if name == "helmet" else ["kilt_nq"]}
            | (fixtures if name == "helmet" else {}),
        }
        try:
            cfg = DatasetsConfig.from_config(section)
            frames.append(materialize_stratum(cfg, cfg.strata[0].name, length_fn))
        except DatasetError as exc:
            raise CompareError(f"--tasks {name}: {' '.join(str(exc).split())}") from None
    documents = pl.concat(frames)

    def metric_of(stratum: str, task: str) -> str:
        env = stratum.split("-", 1)[0]
        return environment(env).metric(None, task)  # the metric depends on the task alone

    return documents, metric_of


def task_keys(documents: pl.DataFrame) -> pl.DataFrame:
    """doc_id → a name for messages and tables (``user_id``: ``<task> #<k>``) and ``line``
    (the doc_id), as a prompts file's ids and lines."""
    names, seen = [], {}
    for task in documents["task"].to_list():
        seen[task] = seen.get(task, 0) + 1
        names.append(f"{task} #{seen[task]}")
    return pl.DataFrame(
        {"doc_id": documents["doc_id"], "user_id": names, "line": documents["doc_id"]},
        schema={"doc_id": pl.String, "user_id": pl.String, "line": pl.String},
    )
