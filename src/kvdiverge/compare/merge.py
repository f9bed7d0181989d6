"""``kvdiverge merge FOLDER...``: several runs' ``metrics.json`` in one table and one figure.

Each FOLDER is a compare folder, a study's folder (``results/<study>``) or a ``metrics.json``
itself (:func:`kvdiverge.tables.metrics.read_metrics`). Runs are merged only when their
numbers are comparable: every setting of :data:`kvdiverge.tables.metrics.COMPARED_SETTINGS`
(the horizon H, the temperature, K, the coupling, the interval level, the bootstrap draws,
the accuracy metric and the documents) must agree, unless ``allow`` names it; a difference is
one :class:`MergeError` line naming both files, the field and both values, before anything is
written. Models, actions and seeds may differ: they are what a merge puts side by side.

Outputs (:func:`write_merge`): ``merged.csv`` (every pooled estimand, contrast and accuracy row
of every run, with the run's name, kind and the settings that were allowed to differ),
``merged.md`` and ``merged.html`` (one row per run, model and action: P(τ ≤ H), E[τ | τ ≤ H],
R_SMC and Y's task accuracy with their intervals, then each contrast against the baseline) and
``merged.{png,pdf}`` (the three divergence measures per action, one colour per run, with
intervals; :mod:`kvdiverge.plots.merge`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl

from kvdiverge.compare.actions import CompareError
from kvdiverge.tables.metrics import COMPARED_SETTINGS, MetricsError, read_metrics

__all__ = [
    "HEADLINE",
    "MergeError",
    "check_comparable",
    "merge_runs",
    "merged_markdown",
    "write_merge",
]

HEADLINE = {
    "div_prob": ("P(τ ≤ H)", 100.0, "%"),
    "mean_entry_time": ("E[τ | τ ≤ H]", 1.0, " steps"),
    "R_smc": ("R_SMC", 100.0, "%"),
    "accuracy_y": ("accuracy (Y)", 100.0, "%"),
}
"""The merged table's columns per action: estimand → (heading, scale, unit)."""
_CONTRASTS = {
    "R_smc": "ΔR_SMC, pp",
    "div_prob": "Δ P(τ ≤ H), pp",
    "mean_entry_time": "Δ E[τ | τ ≤ H], steps",
    "accuracy": "Δ accuracy (Y), pp",
}
_COLUMNS = ("value", "ci_low", "ci_high", "ci_level", "n_docs")


class MergeError(CompareError):
    """A set of runs that cannot be merged (one line naming the files and the field)."""


def check_comparable(records: Sequence[dict[str, Any]], allow: Sequence[str] = ()) -> list[str]:
    """Refuse runs whose :data:`COMPARED_SETTINGS` differ (except those in ``allow``); return
    the settings that differ among the allowed ones (they become columns of the table)."""
    unknown = [f for f in allow if f not in COMPARED_SETTINGS]
    if unknown:
        raise MergeError(
            f"--allow: {unknown[0]!r} is not a compared setting; expected one of "
            f"{', '.join(COMPARED_SETTINGS)}"
        )
    first = records[0]
    differing = []
    for field in COMPARED_SETTINGS:
        values = [r["settings"].get(field) for r in records]
        odd = next((r for r, v in zip(records, values, strict=True) if v != values[0]), None)
        if odd is None:
            continue
        if field not in allow:
            raise MergeError(
                f"{odd['path']}: {field} = {odd['settings'].get(field)!r}, but "
                f"{first['path']}: {field} = {first['settings'].get(field)!r}; runs with "
                f"different {field} are not comparable (pass --allow {field} to merge them "
                "anyway)"
            )
        differing.append(field)
    names = [r["name"] for r in records]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        paths = [r["path"] for r in records if r["name"] == dup]
        if len(set(paths)) < len(paths):
            raise MergeError(f"{paths[0]}: given twice")
    return differing


def _shown(field: str, value: Any) -> str:
    """A differing setting as the table shows it: a digest (``documents``) by its first 12
    hexadecimal digits, anything else as text."""
    text = str(value)
    return text[:12] if field == "documents" and len(text) == 64 else text


def _run_names(records: Sequence[dict[str, Any]]) -> list[str]:
    """Each run's name: its folder or study name, made unique with its parent folder."""
    names = [r["name"] for r in records]
    out = []
    for r, n in zip(records, names, strict=True):
        if names.count(n) > 1:
            n = f"{Path(r['path']).parent.parent.name}/{n}"
        out.append(n)
    return out


def merge_runs(
    paths: Sequence[str | os.PathLike], allow: Sequence[str] = ()
) -> tuple[pl.DataFrame, list[dict[str, Any]]]:
    """The long merged table of ``paths`` (module docstring) and their records, after
    :func:`check_comparable`."""
    if len(paths) < 2:
        raise MergeError("expected at least two folders (compare folders or study folders)")
    try:
        records = [read_metrics(p) for p in paths]
    except MetricsError as exc:
        raise MergeError(str(exc)) from None
    differing = check_comparable(records, allow)
    frames = []
    for run, r in zip(_run_names(records), records, strict=True):
        extra = {f: _shown(f, r["settings"].get(f)) for f in differing}
        for source, rows in (("estimands", r["estimands"]), ("accuracy", r["accuracy"])):
            for row in rows:
                if row.get("stratum") != "pooled":
                    continue
                frames.append(
                    {"run": run, "kind": r["kind"], **extra, "table": source,
                     "model": row.get("model"), "action": row.get("action") or "",
                     "contrast": row.get("contrast") or "", "baseline": "",
                     "estimand": row["estimand"], **{c: row.get(c) for c in _COLUMNS}}
                )  # fmt: skip
        for row in r["contrasts"]:
            frames.append(
                {"run": run, "kind": r["kind"], **extra, "table": "contrasts",
                 "model": row.get("model", r["models"][0] if r["models"] else None),
                 "action": row["action"], "contrast": f"{row['action']} - {row['baseline']}",
                 "baseline": row["baseline"], "estimand": row["estimand"],
                 **{c: row.get(c) for c in _COLUMNS}}
            )  # fmt: skip
    schema = {"run": pl.String, "kind": pl.String, **dict.fromkeys(differing, pl.String)}
    schema |= {"table": pl.String, "model": pl.String, "action": pl.String}
    schema |= {"contrast": pl.String, "baseline": pl.String, "estimand": pl.String}
    schema |= {"value": pl.Float64, "ci_low": pl.Float64, "ci_high": pl.Float64}
    schema |= {"ci_level": pl.Float64, "n_docs": pl.Int64}
    return pl.DataFrame(frames, schema=schema, strict=False), records


def _cell(row: dict[str, Any] | None, scale: float, unit: str) -> str:
    if row is None or row["value"] is None or not math.isfinite(row["value"]):
        return "undefined" if row is not None else "—"
    digits = 1
    text = f"{scale * row['value']:.{digits}f}{unit}"
    low, high = row["ci_low"], row["ci_high"]
    if low is not None and high is not None and math.isfinite(low) and math.isfinite(high):
        text += f" [{scale * low:.{digits}f}, {scale * high:.{digits}f}]"
    return re.sub(r"-0\.0(?!\d)", "0.0", text)


def _tables(merged: pl.DataFrame) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    """The headline rows (run, model, action, each :data:`HEADLINE` cell) and the contrast rows
    (run, model, action − baseline, each contrast cell), as text."""
    keys = [c for c in merged.columns if c not in ("table", "contrast", "baseline", "estimand")]
    keys = [c for c in keys if c not in _COLUMNS and c not in ("kind",)]
    own = merged.filter((pl.col("table") != "contrasts") & (pl.col("contrast") == ""))
    head = [*keys, *(h for h, _, _ in HEADLINE.values())]
    rows = []
    for key, group in own.group_by(keys, maintain_order=True):
        by = {r["estimand"]: r for r in group.iter_rows(named=True)}
        rows.append(
            [*map(str, key), *(_cell(by.get(e), s, u) for e, (_, s, u) in HEADLINE.items())]
        )
    con = merged.filter(pl.col("table") == "contrasts")
    ckeys = [k for k in keys if k != "action"] + ["contrast"]
    chead = [*ckeys, *_CONTRASTS.values()]
    crows = []
    for key, group in con.group_by(ckeys, maintain_order=True):
        by = {r["estimand"]: r for r in group.iter_rows(named=True)}
        cells = [_cell(by.get(e), 1.0 if e == "mean_entry_time" else 100.0, "") for e in _CONTRASTS]
        crows.append([*map(str, key), *cells])
    return head, rows, chead, crows


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def merged_markdown(merged: pl.DataFrame, records: Sequence[dict[str, Any]]) -> str:
    """``merged.md``: the runs merged, one row per run, model and action, then the contrasts."""
    head, rows, chead, crows = _tables(merged)
    level = next((float(v) for v in merged["ci_level"].to_list() if v is not None), 0.95)
    lines = [
        "# Merged runs",
        "",
        f"{len(records)} runs: "
        + ", ".join(f"{r['name']} ({r['kind']}, {r['path']})" for r in records)
        + f". Brackets: {100 * level:g}% document-bootstrap intervals of each run.",
        "",
        "| " + " | ".join(map(_md, head)) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(map(_md, r)) + " |" for r in rows),
    ]
    if crows:
        lines += [
            "",
            "Each action minus its run's baseline (percentage points; entry time in steps):",
            "",
            "| " + " | ".join(map(_md, chead)) + " |",
            "|" + "---|" * len(chead),
            *("| " + " | ".join(map(_md, r)) + " |" for r in crows),
        ]
    return "\n".join(lines) + "\n"


def _html(merged: pl.DataFrame, records: Sequence[dict[str, Any]]) -> str:
    from kvdiverge.tables.render import html_document, html_text

    head, rows, chead, crows = _tables(merged)

    def table(head: list[str], rows: list[list[str]]) -> str:
        th = "".join(f"<th>{html_text(h)}</th>" for h in head)
        body = "".join(
            "<tr>" + "".join(f"<td>{html_text(c)}</td>" for c in r) + "</tr>" for r in rows
        )
        return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"

    runs = ", ".join(f"{r['name']} ({r['kind']})" for r in records)
    body = f"<p>{html_text(runs)}</p>" + table(head, rows)
    if crows:
        body += "<p>Each action minus its run's baseline</p>" + table(chead, crows)
    return html_document("merged runs", body)


def write_merge(merged: pl.DataFrame, records: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    """``merged.{csv,md,html,png,pdf}`` in ``out`` (made if needed), each atomically; returns
    the paths."""
    from kvdiverge.io import atomic_path, atomic_write_text
    from kvdiverge.plots.base import save_figure
    from kvdiverge.plots.merge import plot_merged

    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "merged.csv", suffix=".csv") as tmp:
        merged.write_csv(tmp)
    atomic_write_text(out / "merged.md", merged_markdown(merged, records))
    atomic_write_text(out / "merged.html", _html(merged, records))
    save_figure(plot_merged(merged), out / "merged.png", out / "merged.pdf")
    return [out / f"merged.{e}" for e in ("csv", "md", "html", "png", "pdf")]
