"""Reading and checking the analysis outputs the tables and figures draw from: the long
estimands table (``estimands.csv``) and the prediction table (``prediction.csv``), and the
strata, contrasts, actions and models they hold.

Namesake: :mod:`kvdiverge.compare.inputs` checks ``kvdiverge compare``'s own inputs (numbers,
prompts, actions) before a run; this module reads a study's analysis outputs after one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import polars as pl

from kvdiverge.analysis.estimands import ESTIMAND_COLUMNS
from kvdiverge.analysis.prediction import PREDICTION_COLUMNS


class StudyTableError(ValueError):
    """An estimands or prediction table lacks what a figure or table needs (one-line message)."""


def read_estimands(path: str | os.PathLike) -> pl.DataFrame:
    """Read ``estimands.csv``; empty action/contrast cells become ``""``.

    A table written before the ``draws_dropped`` column existed reads with that column null
    (unknown), so its tables still render.

    Raises :class:`StudyTableError` naming the file when it is missing, lacks a column or
    holds no rows.
    """
    path = Path(path)
    if not path.is_file():
        raise StudyTableError(f"{path}: expected the estimands table, not found")
    table = pl.read_csv(path, infer_schema_length=None)
    if "draws_dropped" not in table.columns:  # written before the column existed: unknown
        table = table.with_columns(draws_dropped=pl.lit(None, dtype=pl.Int64))
    missing = [c for c in ESTIMAND_COLUMNS if c not in table.columns]
    if missing:
        raise StudyTableError(f"{path}: missing column(s) {', '.join(missing)}")
    if table.height == 0:
        raise StudyTableError(f"{path}: expected estimand rows, found none")
    return table.with_columns(
        pl.col("model", "action", "contrast", "stratum", "estimand").cast(pl.String).fill_null(""),
        pl.col("value", "ci_low", "ci_high", "ci_level").cast(pl.Float64),
        pl.col("draws_dropped").cast(pl.Int64),
    ).select(ESTIMAND_COLUMNS)


def read_prediction(path: str | os.PathLike) -> pl.DataFrame:
    """Read ``prediction.csv`` (the prediction rule's long table); empty cells become ``""``."""
    path = Path(path)
    if not path.is_file():
        raise StudyTableError(f"{path}: expected the prediction table, not found")
    table = pl.read_csv(path, infer_schema_length=None)
    missing = [c for c in PREDICTION_COLUMNS if c not in table.columns]
    if missing:
        raise StudyTableError(f"{path}: missing column(s) {', '.join(missing)}")
    return table.with_columns(
        pl.col("model", "observation", "predictor", "contrast", "quantity", "decision")
        .cast(pl.String)
        .fill_null(""),
        pl.col("value", "ci_low", "ci_high", "ci_level").cast(pl.Float64),
    )


def require_estimands(
    table: pl.DataFrame, names: Sequence[str], where: str, needed_by: str
) -> None:
    """Raise one clear line naming the first estimand of ``names`` absent from ``table``."""
    present = set(table["estimand"].unique().to_list())
    for name in names:
        if name not in present:
            raise StudyTableError(f"{where}: estimand {name!r} missing (needed by {needed_by})")


def _natural_key(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def strata_in(table: pl.DataFrame) -> list[str]:
    """The strata of ``table`` other than ``pooled`` (env × length strata), in natural
    order (helmet-4k < helmet-16k < ruler-4k)."""
    found = {s for s in table["stratum"].unique().to_list() if s != "pooled"}
    return sorted(found, key=lambda s: _natural_key(s.lower().replace("k", "000")))


def stratum_label(stratum: str) -> str:
    """``helmet-4k`` → ``HELMET–4K``, the paper's labels of the strata; ``pooled`` stays."""
    if stratum == "pooled":
        return "pooled"
    env, _, length = stratum.partition("-")
    return f"{env.upper()}–{length.upper()}" if length else env.upper()


def contrasts_in(table: pl.DataFrame) -> list[str]:
    """The contrast labels ``b - a`` (of the gap decomposition) of ``table``, in
    order of first appearance."""
    return [c for c in table["contrast"].unique(maintain_order=True).to_list() if c]


def contrast_actions(contrast: str) -> tuple[str, str]:
    """``"b - a"`` → ``("b", "a")``: the actions of the contrast Δ = b − a."""
    b, sep, a = contrast.partition(" - ")
    if not sep or not b or not a:
        raise StudyTableError(f"contrast: expected a label 'b - a', got {contrast!r}")
    return b, a


def default_main_contrast(table: pl.DataFrame, where: str = "estimands") -> str:
    """The first contrast of the table (the first action pair of the study)."""
    found = contrasts_in(table)
    if not found:
        raise StudyTableError(f"{where}: no contrast rows (a study needs two compared actions)")
    return found[0]


def actions_in(table: pl.DataFrame) -> list[str]:
    return [a for a in table["action"].unique(maintain_order=True).to_list() if a]


def models_in(table: pl.DataFrame) -> list[str]:
    return table["model"].unique(maintain_order=True).to_list()


def pooled_support(table: pl.DataFrame, model: str, action: str, estimand: str) -> tuple[int, int]:
    """``(n_docs, n_paths)`` of the pooled row of ``estimand`` for ``model`` × ``action``: the
    documents and paths behind a table row."""
    row = table.filter(
        (pl.col("model") == model)
        & (pl.col("action") == action)
        & (pl.col("stratum") == "pooled")
        & (pl.col("estimand") == estimand)
    )
    return row["n_docs"][0], row["n_paths"][0]
