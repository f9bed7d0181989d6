"""``kvdiverge compare --budgets``: each method at several budgets, and the divergence measures
against the budget.

:func:`kvdiverge.compare.actions.sweep_budgets` expands every method over the budgets; this module
collects the pooled estimands of the swept actions (``budget_sweep.csv``: P(τ ≤ H), the mean entry
time E[τ | τ ≤ H] and R_SMC with their intervals, per method and budget) and draws them against
the budget, one line per method (``budget_sweep.{png,pdf}``), with the baseline, when there is one,
as a dashed horizontal line. The table and the figure are :mod:`kvdiverge.plots.sweep`'s, which
also draws a study's sweep figure in the pipeline.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from kvdiverge.plots.sweep import SWEEP_ESTIMANDS, plot_sweep, sweep_table

__all__ = ["SWEEP_ESTIMANDS", "plot_sweep", "sweep_table", "write_sweep"]


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
