"""``kvdiverge compare --budgets``: each method at several budgets, and the divergence measures
against the budget.

:func:`kvdiverge.compare.actions.sweep_budgets` expands every method over the budgets; this module
collects the pooled estimands of the swept actions (``budget_sweep.csv``: P(τ ≤ H), the mean entry
time E[τ | τ ≤ H] and R_SMC with their intervals, per method and budget) and draws them against
the budget, one line per method (``budget_sweep.{png,pdf}``). A baseline with a budget is swept
too (a paired grid): it is a line of its own, and ``budget_contrasts.{csv,md}`` holds each
method minus the baseline at the same budget, with both sides' kept entries and KV-cache
bytes; a baseline without one (``full``) is a dashed horizontal line. The table and the figure
are :mod:`kvdiverge.plots.sweep`'s, which also draws a study's sweep figure in the pipeline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import polars as pl

from kvdiverge.plots.sweep import SWEEP_ESTIMANDS, plot_sweep, sweep_table

__all__ = [
    "BUDGET_CONTRASTS",
    "SWEEP_ESTIMANDS",
    "budget_contrast_table",
    "kv_bytes_per_entry",
    "plot_sweep",
    "render_budget_contrasts",
    "sweep_table",
    "write_budget_contrasts",
    "write_sweep",
]


def write_sweep(
    table: pl.DataFrame,
    estimands: pl.DataFrame,
    baseline: str | None,
    root: Path,
    baseline_method: str | None = None,
) -> None:
    """``budget_sweep.csv`` and ``budget_sweep.{png,pdf}``, atomically; ``baseline_method``:
    the swept baseline's method (a paired grid: drawn as a line of its own, every budget)."""
    from kvdiverge.io import atomic_path
    from kvdiverge.plots.base import save_figure

    with atomic_path(root / "budget_sweep.csv", suffix=".csv") as tmp:
        table.write_csv(tmp)
    fig = plot_sweep(table, estimands, baseline, baseline_method=baseline_method)
    save_figure(fig, root / "budget_sweep.png", root / "budget_sweep.pdf")


BUDGET_CONTRASTS = ("R_smc", "div_prob", "mean_entry_time", "accuracy")
"""The contrasts of ``budget_contrasts.{csv,md}``, in order."""
_HEADINGS = {
    "R_smc": "ΔR_SMC, pp",
    "div_prob": "Δ P(τ ≤ H), pp",
    "mean_entry_time": "Δ E[τ \\| τ ≤ H], steps",
    "accuracy": "Δ accuracy, pp",
}


def kv_bytes_per_entry(config: object, element_size: int) -> int | None:
    """Bytes one kept prompt position takes in the KV cache: keys and values of every layer
    and KV head, 2 · layers · KV heads · head size · ``element_size``; None when the model
    config does not give them."""
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    size = getattr(config, "head_dim", None)
    hidden = getattr(config, "hidden_size", None)
    if size is None and hidden and heads:
        size = hidden // heads
    if not (layers and kv and size):
        return None
    return 2 * int(layers) * int(kv) * int(size) * int(element_size)


def budget_contrast_table(
    contrasts: pl.DataFrame,
    sweep: Mapping[str, tuple[str, float | int]],
    kept: Mapping[str, float],
    bytes_per_entry: int | None,
) -> pl.DataFrame:
    """The compression-ratio table: per swept method and budget, each headline contrast
    (:data:`BUDGET_CONTRASTS`) of the action against the baseline at the same budget, with
    its paired interval, and both sides' mean kept entries (``kept``: action → mean kept
    prompt positions) and KV-cache bytes (``bytes_per_entry`` each; null when unknown): a
    paired grid compares at equal budget, so both sides keep the same entries."""
    rows = []
    for r in contrasts.filter(pl.col("estimand").is_in(BUDGET_CONTRASTS)).iter_rows(named=True):
        if r["action"] not in sweep:
            continue
        method, budget = sweep[r["action"]]
        a_kept, b_kept = kept.get(r["action"]), kept.get(r["baseline"])
        rows.append(
            {
                "method": method,
                "budget": float(budget),
                "action": r["action"],
                "baseline": r["baseline"],
                "kept_entries": a_kept,
                "baseline_kept_entries": b_kept,
                "kv_bytes": None if bytes_per_entry is None or a_kept is None
                else a_kept * bytes_per_entry,
                "baseline_kv_bytes": None if bytes_per_entry is None or b_kept is None
                else b_kept * bytes_per_entry,
                **{k: r[k] for k in ("estimand", "value", "ci_low", "ci_high", "ci_level")},
                "n_docs": r["n_docs"],
            }
        )  # fmt: skip
    schema = {
        "method": pl.String, "budget": pl.Float64, "action": pl.String, "baseline": pl.String,
        "kept_entries": pl.Float64, "baseline_kept_entries": pl.Float64,
        "kv_bytes": pl.Float64, "baseline_kv_bytes": pl.Float64, "estimand": pl.String,
        "value": pl.Float64, "ci_low": pl.Float64, "ci_high": pl.Float64,
        "ci_level": pl.Float64, "n_docs": pl.Int64,
    }  # fmt: skip
    order = {e: i for i, e in enumerate(BUDGET_CONTRASTS)}
    methods = {m: i for i, m in enumerate(dict.fromkeys(m for m, _ in sweep.values()))}
    return (
        pl.DataFrame(rows, schema=schema)
        .with_columns(
            _m=pl.col("method").replace_strict(methods, return_dtype=pl.Int64),
            _e=pl.col("estimand").replace_strict(order, return_dtype=pl.Int64),
        )
        .sort("_m", "budget", "_e")
        .drop("_m", "_e")
    )


def _number(x: float) -> str:
    text = f"{x:.1f}"
    return text.lstrip("-") if float(text) == 0 else text


def _cell(value: float | None, low: float | None, high: float | None, scale: float) -> str:
    if value is None or not math.isfinite(value):
        return "undefined"
    bounds = [b for b in (low, high) if b is not None and math.isfinite(b)]
    interval = f" [{_number(scale * low)}, {_number(scale * high)}]" if len(bounds) == 2 else ""
    return f"{_number(scale * value)}{interval}"


def render_budget_contrasts(table: pl.DataFrame) -> str:
    """``budget_contrasts.md``: one row per method and budget, the kept entries and KV cache
    of both sides, then each contrast with its interval."""
    if table.height == 0:
        return "No swept action has a baseline at its budget.\n"
    level = float(table["ci_level"][0])
    head = ["method", "budget", "against", "kept entries (both)", "KV cache (both)"]
    head += [_HEADINGS[e] for e in BUDGET_CONTRASTS]
    lines = [
        f"Each method minus the baseline at the same budget (paired {100 * level:g}% "
        "document-bootstrap intervals).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    fractions = all(b <= 1 for b in table["budget"].to_list())
    for _, rows in table.group_by(["method", "budget", "action"], maintain_order=True):
        by = {r["estimand"]: r for r in rows.iter_rows(named=True)}
        first = rows.row(0, named=True)
        kept = first["kept_entries"]
        mib = first["kv_bytes"]
        budget = first["budget"]
        cells = [
            first["method"].replace("|", "\\|"),
            f"{100 * budget:g}%" if fractions else f"{budget:g} tokens",
            first["baseline"].replace("|", "\\|"),
            "NA" if kept is None else f"{kept:.1f}",
            "NA" if mib is None else f"{mib / 2**20:.2f} MiB",
        ]
        for e in BUDGET_CONTRASTS:
            r = by.get(e)
            scale = 1.0 if e == "mean_entry_time" else 100.0
            cells.append("—" if r is None else _cell(r["value"], r["ci_low"], r["ci_high"], scale))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_budget_contrasts(table: pl.DataFrame, root: Path) -> None:
    """``budget_contrasts.csv`` and ``budget_contrasts.md``, atomically."""
    from kvdiverge.io import atomic_path, atomic_write_text

    with atomic_path(root / "budget_contrasts.csv", suffix=".csv") as tmp:
        table.write_csv(tmp)
    atomic_write_text(root / "budget_contrasts.md", render_budget_contrasts(table))
