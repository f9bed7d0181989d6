"""``kvdiverge compare --budgets``: each method at several budgets, and the divergence measures
against the budget.

:func:`kvdiverge.compare.actions.sweep_budgets` expands every method over the budgets; this module
collects the pooled estimands of the swept actions (``budget_sweep.csv``: P(τ ≤ H), the mean entry
time E[τ | τ ≤ H] and R_SMC with their intervals, per method and budget) and draws them against
the budget, one line per method (``budget_sweep.{png,pdf}``), with the baseline, when there is one,
as a dashed horizontal line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import polars as pl

__all__ = ["SWEEP_ESTIMANDS", "plot_sweep", "sweep_table", "write_sweep"]

SWEEP_ESTIMANDS = {
    "div_prob": (r"$P(\tau \leq H)$", 100.0, "%"),
    "mean_entry_time": (r"$E[\tau \mid \tau \leq H]$", 1.0, " steps"),
    "R_smc": (r"$R_{\mathrm{SMC}}$", 100.0, "%"),
}
"""The swept estimands: axis label, scale and unit."""


def sweep_table(
    estimands: pl.DataFrame, sweep: Mapping[str, tuple[str, float | int]]
) -> pl.DataFrame:
    """``budget_sweep.csv``: the pooled rows of :data:`SWEEP_ESTIMANDS` of every swept action,
    with its ``method`` and ``budget``, sorted by method (in the order given) and budget."""
    rows = estimands.filter(
        (pl.col("stratum") == "pooled")
        & (pl.col("contrast") == "")
        & pl.col("action").is_in(list(sweep))
        & pl.col("estimand").is_in(list(SWEEP_ESTIMANDS))
    )
    methods = list(dict.fromkeys(m for m, _ in sweep.values()))
    order = {m: i for i, m in enumerate(methods)}
    return (
        rows.with_columns(
            method=pl.col("action").replace_strict({a: m for a, (m, _) in sweep.items()}),
            budget=pl.col("action").replace_strict(
                {a: float(b) for a, (_, b) in sweep.items()}, return_dtype=pl.Float64
            ),
        )
        .with_columns(_m=pl.col("method").replace_strict(order))
        .sort("_m", "budget", "estimand")
        .select(
            "method",
            "budget",
            "action",
            "estimand",
            "value",
            "ci_low",
            "ci_high",
            "ci_level",
            "n_docs",
        )  # fmt: skip
    )


def plot_sweep(
    table: pl.DataFrame, estimands: pl.DataFrame | None = None, baseline: str | None = None
):
    """Three panels (P(τ ≤ H), mean entry time, R_SMC) against the budget: one line per method
    with its intervals; the baseline's value dashed where given."""
    import textwrap

    from matplotlib.lines import Line2D

    from kvdiverge.plots.base import TEXT_WIDTH, figure_legend, new_figure, series_styles

    methods = table["method"].unique(maintain_order=True).to_list()
    styles = series_styles(methods)
    budgets = sorted(set(table["budget"].to_list()))
    fractions = all(0 < b <= 1 for b in budgets)
    fig, axes = new_figure(TEXT_WIDTH, 2.6, 1, len(SWEEP_ESTIMANDS))
    base_rows = {}
    if estimands is not None and baseline is not None:
        own = estimands.filter(
            (pl.col("stratum") == "pooled")
            & (pl.col("contrast") == "")
            & (pl.col("action") == baseline)
        )
        base_rows = dict(zip(own["estimand"], own["value"], strict=True))
    for ax, (estimand, (label, scale, unit)) in zip(axes[0], SWEEP_ESTIMANDS.items(), strict=True):
        rows = table.filter(pl.col("estimand") == estimand)
        finite = [v for v in rows["value"].to_list() if v is not None and math.isfinite(v)]
        if not finite:
            ax.text(0.5, 0.5, "undefined at every budget\n(no path diverges)", ha="center",
                    va="center", transform=ax.transAxes)  # fmt: skip
        for method in methods:
            r = rows.filter(pl.col("method") == method).sort("budget")
            x = r["budget"].to_numpy() * (100.0 if fractions else 1.0)
            v, lo, hi = (scale * r[c].to_numpy() for c in ("value", "ci_low", "ci_high"))
            style = styles[method]
            drawn = ax.errorbar(x, v, yerr=[v - lo, hi - v], marker=style.marker, ms=4,
                                capsize=2.5, **style.line())  # fmt: skip
            drawn.lines[0].set_gid(f"method:{method}")
        value = base_rows.get(estimand)
        if value is not None and math.isfinite(value):
            ax.axhline(scale * value, color="0.35", ls="--", lw=1, zorder=1, gid="baseline")
        ax.set_xticks([b * (100.0 if fractions else 1.0) for b in budgets])
        ax.set_xlabel("kept cache, % of the prompt" if fractions else "kept entries (tokens)")
        ax.set_ylabel(label + (", %" if unit == "%" else ", steps"))
    handles = [Line2D([], [], marker=styles[m].marker, **styles[m].line()) for m in methods]
    labels = list(methods)
    if base_rows:
        handles.append(Line2D([], [], color="0.35", ls="--", lw=1))
        labels.append(f"baseline {baseline}")
    level = table["ci_level"][0] if table.height else 0.95
    title = textwrap.fill(f"method (bars: pointwise {100 * level:g}% intervals)", 90)
    figure_legend(fig, handles, labels, title, ncol=min(len(labels), 4))
    return fig


def write_sweep(
    table: pl.DataFrame, estimands: pl.DataFrame, baseline: str | None, root: Path
) -> None:
    """``budget_sweep.csv`` and ``budget_sweep.{png,pdf}``, atomically."""
    from kvdiverge.io import atomic_path
    from kvdiverge.plots.base import save_figure

    with atomic_path(root / "budget_sweep.csv", suffix=".csv") as tmp:
        table.write_csv(tmp)
    fig = plot_sweep(table, estimands, baseline)
    save_figure(fig, root / "budget_sweep.png", root / "budget_sweep.pdf")
