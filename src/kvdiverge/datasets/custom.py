"""The ``custom`` dataset environment: the user's own prompts from a JSONL or Parquet file.

A stratum ``{env: custom, label, target_tokens, path, fit, metric}`` reads ``path``: JSON Lines
(one object per line; blank lines skipped) or Parquet (one row per record). Fields:

* ``prompt`` (string, required) — the user message (the chat template is applied per model);
* ``answers`` (list of strings, or one string; required, at least one) — gold answers;
* ``id`` (string or integer, optional, unique) — kept in the ``source`` column;
* ``task`` (string, optional) — the ``task`` column (default ``custom``);
* ``context`` (string, optional) — text put where the prompt says ``{context}``.

Other fields are ignored; a prompt holding ``{context}`` without a ``context`` field (a
misspelt field, most often) is an error, never a prompt that runs with the literal placeholder.
Lines end at ``\n`` alone (a raw U+2028 or U+0085 inside a JSON string is text).

``fit`` says how a prompt meets the stratum's length:

* ``as_given`` (default) — the prompt as written (with its whole ``context`` in place of
  ``{context}``); a prompt longer than target_tokens − generation_reserve tokens is an error;
* ``truncate`` — every record has a ``context`` and its prompt holds ``{context}`` once; the
  context is cut from its end until the prompt fits, as HELMET fits its passages
  (:func:`kvdiverge.datasets.fitting.truncate_context`).

The stratum's documents take the records in file order (dev, then study1, then study2). Scored
by ``metric`` (default ``substring_match``; any name of :data:`kvdiverge.datasets.scoring.METRICS`).
Every error is one line naming the file, the line (JSONL) or row (Parquet) and the field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvdiverge.datasets.fitting import (
    DatasetError,
    LengthFitError,
    LengthFn,
    MissingSourceError,
    describe_length,
    truncate_context,
)
from kvdiverge.datasets.registry import DatasetEnvironment, document_row, register_environment
from kvdiverge.datasets.scoring import METRICS

if TYPE_CHECKING:
    from kvdiverge.datasets.strata import DatasetsConfig, DocumentSlot, Stratum

__all__ = [
    "FITS",
    "CustomEnvironment",
    "CustomRecord",
    "count_custom_records",
    "read_custom_records",
]

FITS: tuple[str, ...] = ("as_given", "truncate")
"""The ways a custom prompt meets its stratum's length (module docstring)."""
PLACEHOLDER = "{context}"
DEFAULT_TASK = "custom"


@dataclass(frozen=True)
class CustomRecord:
    """One record of a custom prompts file; ``where`` names it (``file, line 3``)."""

    prompt: str
    answers: tuple[str, ...]
    id: str | None
    task: str
    context: str | None
    where: str


def _text(value: Any, where: str, field: str, required: bool) -> str | None:
    if value is None:
        if required:
            raise DatasetError(f"{where}, field {field!r}: missing")
        return None
    if not isinstance(value, str):
        raise DatasetError(
            f"{where}, field {field!r}: expected a string, got {type(value).__name__}"
        )
    if required and not value.strip():
        raise DatasetError(f"{where}, field {field!r}: empty")
    return value


def _answers(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        raise DatasetError(f"{where}, field 'answers': missing")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(a, str) for a in value):
        raise DatasetError(f"{where}, field 'answers': expected a string or a list of strings")
    if not [a for a in value if a.strip()]:
        raise DatasetError(f"{where}, field 'answers': expected at least one non-empty answer")
    return tuple(a for a in value if a.strip())


def _record(row: Mapping[str, Any], where: str) -> CustomRecord:
    ident = row.get("id")
    if ident is not None and (isinstance(ident, bool) or not isinstance(ident, (str, int))):
        raise DatasetError(
            f"{where}, field 'id': expected a string or an integer, got {type(ident).__name__}"
        )
    record = CustomRecord(
        prompt=_text(row.get("prompt"), where, "prompt", True),
        answers=_answers(row.get("answers"), where),
        id=None if ident is None else str(ident),
        task=_text(row.get("task"), where, "task", False) or DEFAULT_TASK,
        context=_text(row.get("context"), where, "context", False),
        where=where,
    )
    _check_placeholder(record, row)
    return record


FIELDS = ("prompt", "answers", "id", "task", "context")
"""The fields a record may hold (module docstring); others are ignored."""


def _check_placeholder(record: CustomRecord, row: Mapping[str, Any]) -> None:
    """A prompt that says ``{context}`` without a ``context`` field would run with the literal
    placeholder in it (a misspelt field name, most often): one line naming the record and the
    fields it has instead."""
    if record.context is not None or PLACEHOLDER not in record.prompt:
        return
    others = [str(k) for k in row if k not in FIELDS]
    extra = f" (it has {', '.join(repr(k) for k in others)})" if others else ""
    raise DatasetError(
        f"{record.where}, field 'prompt': holds the placeholder {PLACEHOLDER} but the record "
        f"has no field 'context'{extra}; expected a 'context' field to put there, or a prompt "
        "without the placeholder"
    )


def _jsonl_rows(path: Path) -> list[tuple[str, Any]]:
    rows = []
    try:
        # JSON Lines end at "\n" alone: str.splitlines would also split at U+2028, U+0085 and
        # other characters that JSON allows raw inside a string
        lines = [line.removesuffix("\r") for line in path.read_text(encoding="utf-8").split("\n")]
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text ({exc.reason})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
        rows.append((where, row))
    return rows


def _parquet_rows(path: Path) -> list[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DatasetError(f"{path}: not a readable Parquet file ({reason})") from None
    for column in ("prompt", "answers"):
        if column not in table.column_names:
            raise DatasetError(
                f"{path}: no column {column!r} (columns: {', '.join(table.column_names)})"
            )
    return [(f"{path}, row {i}", row) for i, row in enumerate(table.to_pylist(), 1)]


def read_custom_records(path: str | os.PathLike) -> list[CustomRecord]:
    """The records of a ``.jsonl`` or ``.parquet`` prompts file, checked (module docstring);
    one-line :class:`DatasetError` naming the file, line or row and field."""
    path = Path(path)
    if path.suffix not in (".jsonl", ".parquet"):
        raise DatasetError(f"{path}: expected a .jsonl or .parquet file of prompts")
    if not path.is_file():
        raise MissingSourceError(f"{path}: no such file (the custom stratum's prompts)")
    rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path)
    if not rows:
        raise DatasetError(f"{path}: no records")
    records = [_record(row, where) for where, row in rows]
    seen: dict[str, str] = {}
    for r in records:
        if r.id is not None:
            if r.id in seen:
                raise DatasetError(f"{r.where}, field 'id': {r.id!r} repeats {seen[r.id]}")
            seen[r.id] = r.where.rsplit(", ", 1)[1]
    return records


def count_custom_records(path: str | os.PathLike) -> int:
    """The records of a prompts file, counted without checking them: the non-blank lines of a
    ``.jsonl`` file, the rows of a ``.parquet`` file (from its footer); one-line
    :class:`DatasetError` for a Parquet file that cannot be read."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return int(pq.ParquetFile(path).metadata.num_rows)
        except Exception as exc:  # noqa: BLE001 - any pyarrow failure: one line naming the file
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DatasetError(f"{path}: not a readable Parquet file ({reason})") from None
    with path.open("rb") as fh:
        return sum(1 for line in fh if line.strip())


def _check_fit(record: CustomRecord, fit: str) -> None:
    count = record.prompt.count(PLACEHOLDER)
    if fit == "truncate" and record.context is None:
        raise DatasetError(f"{record.where}, field 'context': missing (fit: truncate cuts it)")
    if record.context is not None and count != 1:
        raise DatasetError(
            f"{record.where}, field 'prompt': expected {PLACEHOLDER} once where the context "
            f"goes, found it {count} times"
        )


@register_environment
class CustomEnvironment(DatasetEnvironment):
    """The user's own prompts (module docstring)."""

    name = "custom"
    shared_plan = False
    stratum_keys = ("path", "fit", "metric")

    def stratum_options(self, spec: Mapping[str, Any], target: int, where: str) -> dict[str, Any]:
        """``path`` (required), ``fit`` (``as_given``) and ``metric`` (``substring_match``)."""
        super().stratum_options(spec, target, where)
        path = spec.get("path")
        if not isinstance(path, str) or not path:
            raise DatasetError(f"{where}.path: a custom stratum needs the file of its prompts")
        if Path(path).suffix not in (".jsonl", ".parquet"):
            raise DatasetError(f"{where}.path: expected a .jsonl or .parquet file, got {path!r}")
        fit = spec.get("fit", "as_given")
        if fit not in FITS:
            raise DatasetError(f"{where}.fit: expected one of {', '.join(FITS)}, got {fit!r}")
        metric = spec.get("metric", "substring_match")
        if metric not in METRICS:
            raise DatasetError(
                f"{where}.metric: expected one of {', '.join(METRICS)}, got {metric!r}"
            )
        return {"options": (("fit", fit), ("metric", metric), ("path", path))}

    def check_config(self, cfg: DatasetsConfig) -> None:
        """Before any job (the workflow's parse): each custom stratum's prompts file, where it
        exists, holds records, and at least as many as the stratum's documents
        (``datasets.cohorts``, summed); a file with none, or too few, is one line naming the
        stratum's ``path`` field. The records themselves are checked by the documents job."""
        needed = sum(cfg.cohorts.values())
        for i, stratum in enumerate(cfg.strata):
            if stratum.env != self.name:
                continue
            path = Path(stratum.option("path"))
            if not path.is_file():
                continue  # the documents job names the missing file
            count = count_custom_records(path)
            where = f"config.datasets.strata[{i}].path"
            if count == 0:
                raise DatasetError(
                    f"{where}: {path} holds no records (expected one JSON object per line, "
                    "or one Parquet row, per prompt)"
                )
            if count < needed:
                raise DatasetError(
                    f"{where}: stratum {stratum.name}: the plan needs {needed} documents but "
                    f"{path} holds {count} records; add records or lower datasets.cohorts"
                )

    def tasks(self, cfg: DatasetsConfig, stratum: Stratum) -> tuple[str, ...]:
        """One plan task; each document's ``task`` comes from its record."""
        return (DEFAULT_TASK,)

    def documents(
        self,
        slots: list[DocumentSlot],
        cfg: DatasetsConfig,
        length_fn: LengthFn,
        progress: Callable[[], None],
    ) -> list[dict[str, Any]]:
        """Read and check every record and the record count, then measure or fit each prompt."""
        stratum = slots[0].stratum
        path, fit = stratum.option("path"), stratum.option("fit")
        records = read_custom_records(path)
        if len(slots) > len(records):
            raise DatasetError(
                f"{stratum.name}: the plan needs {len(slots)} documents but {path} holds "
                f"{len(records)} records; lower datasets.cohorts"
            )
        for record in records[: len(slots)]:
            _check_fit(record, fit)
        budget = stratum.target_tokens - cfg.generation_reserve
        rows = []
        for slot in slots:
            record = records[slot.source_index]
            label = record.id if record.id is not None else record.where.rsplit(", ", 1)[1]
            source = f"custom:{path}#{label}"
            if record.context is None:
                prompt = record.prompt
            elif fit == "truncate":
                try:
                    prompt, kept = truncate_context(
                        lambda c, p=record.prompt: p.replace(PLACEHOLDER, c),
                        record.context,
                        length_fn,
                        budget,
                    )
                except LengthFitError as exc:
                    raise LengthFitError(f"{record.where}: {exc}") from None
                share = kept / len(record.context) if record.context else 1.0
                source += f" context_kept={share:.3f}"
            else:
                prompt = record.prompt.replace(PLACEHOLDER, record.context)
            n = length_fn(prompt)
            if n > budget:
                needed = describe_length(
                    length_fn, prompt, cfg.length_tokenizer or "the length tokenizer"
                )
                raise LengthFitError(
                    f"{record.where}: the prompt needs {needed}, over the budget of "
                    f"{budget} (target_tokens {stratum.target_tokens} - generation_reserve "
                    f"{cfg.generation_reserve}); raise target_tokens or give a context with "
                    f"fit: truncate"
                )
            rows.append(
                document_row(slot, prompt, record.answers, source, slot.seed, n, record.task)
            )
            progress()
        return rows

    def source_paths(self, cfg: DatasetsConfig, stratum: Stratum, tasks: set[str]) -> list[Path]:
        """The stratum's prompts file."""
        return [Path(stratum.option("path"))]

    def metric(self, stratum: Stratum, task: str) -> str:
        """The stratum's ``metric``."""
        return stratum.option("metric", "substring_match")
