"""The inputs of ``kvdiverge compare``, checked before any heavy import: the numbers, the
prompts (read and checked as records before torch or transformers is imported: a typo in the
JSONL is one line at once), then, once the model's tokenizer is at hand, the prompts as a
``custom`` stratum's documents and every action against every prompt's length (a token budget
above a prompt's length is refused, as the pipeline refuses it; a prompt too short for a
selector's window gets the fix suggested).

Namesake: :mod:`kvdiverge.tables.inputs` reads a study's analysis outputs (``estimands.csv``,
``prediction.csv``) for the tables; this module checks what a comparison is given.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from kvdiverge.compare.actions import CompareError, LabelledAction

__all__ = [
    "COHORT",
    "STUDY",
    "STRATUM_LABEL",
    "check_budget_lengths",
    "check_numbers",
    "check_prompt_records",
    "replicates_problem",
    "prompt_documents",
    "name_user_prompt",
    "prompts_file",
    "user_documents",
    "user_keys",
    "window_hint",
]

STRATUM_LABEL = "prompts"
"""Label of the one ``custom`` stratum the prompts form (documents ``custom-prompts/...``)."""
COHORT = "study1"
STUDY = "compare"
"""The study a comparison's trajectory files record (:mod:`kvdiverge.io.roles`)."""


def replicates_problem(K: int, H: int, n: int) -> str | None:
    """The line refusing ``--K`` when one action's trajectory file, K · H · n rows for n
    prompts, would hold more than :data:`kvdiverge.pipeline.extremes.MAX_FILE_ROWS` rows (the
    pipeline's bound on a config's replicates), or None."""
    from kvdiverge.pipeline.extremes import MAX_FILE_ROWS

    rows = K * H * n
    if rows <= MAX_FILE_ROWS:
        return None
    prompts = "prompt" if n == 1 else "prompts"
    return (
        f"--K: {K} replicates of {n} {prompts} at --H {H} are {rows} rows in one trajectory "
        f"file; expected at most {MAX_FILE_ROWS // (H * n)} replicates (a file holds at most "
        f"{MAX_FILE_ROWS} rows)"
    )


def check_numbers(K: int, H: int, draws: int, level: float, temperature: float) -> None:
    """The numbers of a comparison, each in its range; one :class:`CompareError` line naming
    the option."""
    if not isinstance(K, int) or isinstance(K, bool) or K < 1:
        raise CompareError(f"--K: expected an integer >= 1, got {K!r}")
    if not isinstance(H, int) or isinstance(H, bool) or H < 4:
        raise CompareError(f"--H: expected an integer >= 4 (the analysis clock), got {H!r}")
    if temperature != 0 and (problem := replicates_problem(K, H, 1)):  # greedy runs K = 1
        raise CompareError(problem)
    if not isinstance(draws, int) or isinstance(draws, bool) or draws < 1:
        raise CompareError(f"--draws: expected an integer >= 1, got {draws!r}")
    if not isinstance(level, float | int) or not 0 < level < 1:
        raise CompareError(f"--level: expected a number in (0, 1), got {level!r}")
    from kvdiverge.config import temperature_value_problem  # the config's rule, as the pipeline's
    from kvdiverge.pipeline.extremes import temperature_problem

    if problem := temperature_value_problem(temperature, "--temperature"):
        raise CompareError(problem)

    if problem := temperature_problem(temperature, "--temperature"):  # NaN kernels near 0
        raise CompareError(problem)


def prompt_documents(
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


def user_keys(documents: pl.DataFrame, records: Sequence, prompts: Path) -> pl.DataFrame:
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


def name_user_prompt(message: str, keys: pl.DataFrame) -> str:
    """A preflight message with the generated doc_id replaced by the user's id and line."""
    for doc_id, user_id, line in keys.rows():
        named = f"prompt {user_id!r} ({line})" if user_id is not None else f"the prompt of {line}"
        message = message.replace(f"doc_id {doc_id!r}", named)
    return message


def prompts_file(prompts: Any, scratch: Path) -> Path:
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


def _record_error(exc: Exception, prompts: Any, path: Path) -> CompareError:
    """A prompts error in the user's terms: records given in Python are named ``record N``."""
    if isinstance(prompts, str | os.PathLike):
        return CompareError(str(exc))
    message = str(exc).replace(f"{path}, line ", "prompts, record ")
    return CompareError(message.replace(str(path), "prompts"))


def check_prompt_records(prompts: Any) -> int:
    """Read and check the prompts as records (fields, JSON, ids; no tokenizer, no torch):
    returns their number; a bad record is one :class:`CompareError` line naming its line."""
    from kvdiverge.datasets import DatasetError
    from kvdiverge.datasets.custom import read_custom_records

    with tempfile.TemporaryDirectory(prefix="kvdiverge-prompts-") as scratch:
        path = prompts_file(prompts, Path(scratch))
        try:
            return len(read_custom_records(path))
        except DatasetError as exc:
            raise _record_error(exc, prompts, path) from None


def check_budget_lengths(
    actions: Sequence[LabelledAction], lengths: Sequence[int], names: Sequence[str], option: str
) -> None:
    """A token budget (an integer) is at most every prompt's length n (chat-wrapped, the
    model's tokens), as the pipeline requires of a stratum: a budget above n would keep the
    whole prompt and run as the full cache under another name. ``names``: each prompt's name
    for the message."""
    for a in actions:
        b = a.action.budget
        if not isinstance(b, int) or isinstance(b, bool) or a.action.keeps_everything:
            continue
        for n, name in zip(lengths, names, strict=True):
            if b > n:
                raise CompareError(
                    f"{option}: action {a.label!r} keeps {b} tokens, more than {name} holds "
                    f"({n} tokens with the chat template); expected a token budget <= the "
                    "shortest prompt's length, or a fraction in (0, 1]"
                )


def window_hint(action: LabelledAction, lengths: Sequence[int]) -> str:
    """The fix for a prompt too short for a selector's ``window`` (SnapKV's observation
    window): the largest power of two that fits every prompt and the budget, as a spec
    (``; e.g. snapkv@0.5+window=16``), or "" when the selector has no window."""
    window = getattr(action.action.method, "window", None)
    if not isinstance(window, int) or not lengths:
        return ""
    fits = min(min(n - 1, action.action.n_keep(n)) for n in lengths)
    if fits < 1:
        return ""
    w = 1 << (fits.bit_length() - 1)
    return f"; a window of at most {fits} tokens fits every prompt: e.g. {action.spec}+window={w}"


def user_documents(
    prompts: Any, H: int, metric: str, length_fn: Callable[[str], int]
) -> tuple[pl.DataFrame, pl.DataFrame, Path | str]:
    """The user's prompts (a file, records or a DataFrame) as documents, their keys
    (:func:`user_keys`) and their source for messages (the file, or "the records given");
    errors name a record given in Python as ``record N``."""
    with tempfile.TemporaryDirectory(prefix="kvdiverge-prompts-") as scratch:
        path = prompts_file(prompts, Path(scratch))
        try:
            documents, records = prompt_documents(path, H, metric, length_fn)
        except CompareError as exc:
            if isinstance(prompts, str | os.PathLike):
                raise
            message = str(exc).replace(f"{path}, line ", "prompts, record ")
            raise CompareError(message.replace(str(path), "prompts")) from None
        keys = user_keys(documents, records, path)
    source = path if isinstance(prompts, str | os.PathLike) else "the records given"
    return documents, keys, source
