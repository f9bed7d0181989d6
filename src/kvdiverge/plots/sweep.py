"""The budget-sweep figure: the divergence measures of each method against its budget,
for ``kvdiverge compare --budgets`` (:mod:`kvdiverge.compare.sweep`) and a study's
figure ``budget_sweep.{png,pdf}`` (rule study_sweep_figure; the swept actions from
:func:`kvdiverge.config.actions.budget_sweeps`).

From the pooled rows of the estimands table only (nothing is re-estimated): per method and
budget b, P(τ ≤ H), the mean entry time E[τ | τ ≤ H] and R_SMC = (1/H) Σ_t P(X_t ≠ Y_t), each
with the table's pointwise interval, drawn against b (the kept percentage of the prompt when
every budget is a fraction, else the kept token count), one line per method, one row of three
panels per model; a baseline, when given, is a dashed horizontal line at its own value, or,
swept with the methods (a paired grid), a black dashed line of its own. The lines are dodged
a little along x (:func:`dodge`) so that intervals at one budget do not hide each other.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Mapping

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import polars as pl  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from kvdiverge.plots.base import (  # noqa: E402
    TEXT_WIDTH,
    SeriesStyle,
    figure_legend,
    new_figure,
    save_figure,
    series_styles,
)
from kvdiverge.tables import StudyTableError, read_estimands  # noqa: E402

__all__ = ["SWEEP_ESTIMANDS", "dodge", "plot_sweep", "sweep_table", "write_sweep_figure"]

SWEEP_ESTIMANDS = {
    "div_prob": (r"$P(\tau \leq H)$", 100.0, "%"),
    "mean_entry_time": (r"$E[\tau \mid \tau \leq H]$", 1.0, " steps"),
    "R_smc": (r"$R_{\mathrm{SMC}}$", 100.0, "%"),
}
"""The swept estimands: axis label, scale and unit."""


def sweep_table(
    estimands: pl.DataFrame,
    sweep: Mapping[str, tuple[str, float | int]],
    by_model: bool = False,
) -> pl.DataFrame:
    """The pooled rows of :data:`SWEEP_ESTIMANDS` of every swept action (``sweep``: action ->
    (method, budget)), with its ``method`` and ``budget``, sorted by method (in the order
    given) and budget; ``by_model`` keeps the ``model`` column first (a study of several
    models), otherwise the table is one model's (``kvdiverge compare``'s
    ``budget_sweep.csv``)."""
    rows = estimands.filter(
        (pl.col("stratum") == "pooled")
        & (pl.col("contrast") == "")
        & pl.col("action").is_in(list(sweep))
        & pl.col("estimand").is_in(list(SWEEP_ESTIMANDS))
    )
    methods = list(dict.fromkeys(m for m, _ in sweep.values()))
    order = {m: i for i, m in enumerate(methods)}
    keys = ["model"] if by_model else []
    return (
        rows.with_columns(
            method=pl.col("action").replace_strict({a: m for a, (m, _) in sweep.items()}),
            budget=pl.col("action").replace_strict(
                {a: float(b) for a, (_, b) in sweep.items()}, return_dtype=pl.Float64
            ),
        )
        .with_columns(_m=pl.col("method").replace_strict(order))
        .sort(*keys, "_m", "budget", "estimand", maintain_order=True)
        .select(
            *keys,
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


def dodge(index: int, count: int, span: float, share: float = 0.025) -> float:
    """The x offset of line ``index`` of ``count`` (centred on 0): ``share`` of the axis
    ``span`` per line, so that intervals at one budget sit side by side."""
    return (index - (count - 1) / 2) * share * span


def plot_sweep(
    table: pl.DataFrame,
    estimands: pl.DataFrame | None = None,
    baseline: str | None = None,
    baseline_label: str | None = None,
    baseline_method: str | None = None,
) -> plt.Figure:
    """Three panels (P(τ ≤ H), mean entry time, R_SMC) against the budget, one row per model
    (a ``model`` column, :func:`sweep_table` with ``by_model``): one line per method with its
    intervals; the baseline's value (action ``baseline`` of ``estimands``, shown as
    ``baseline_label``, default its name) dashed where given. ``baseline_method``: a method of
    the table that is the baseline swept with the others (a paired grid): its line is black
    and dashed, with its intervals at every budget, and named "(baseline)" in the legend."""
    methods = table["method"].unique(maintain_order=True).to_list()
    if baseline_method in methods:  # the baseline's line first, then the methods'
        methods = [baseline_method] + [m for m in methods if m != baseline_method]
    styles = dict(series_styles([m for m in methods if m != baseline_method]))
    if baseline_method in methods:  # black and dashed; the methods keep their own styles
        styles[baseline_method] = SeriesStyle("black", "--", "D")
    budgets = sorted(set(table["budget"].to_list()))
    fractions = all(0 < b <= 1 for b in budgets)
    scale_x = 100.0 if fractions else 1.0
    models = table["model"].unique(maintain_order=True).to_list() if "model" in table else [None]
    fig, axes = new_figure(TEXT_WIDTH, 0.6 + 2.0 * len(models), len(models), len(SWEEP_ESTIMANDS))
    drew_baseline = False
    for row, model in zip(axes, models, strict=True):
        own = table if model is None else table.filter(pl.col("model") == model)
        base_rows = {}
        if estimands is not None and baseline is not None:
            base = estimands.filter(
                (pl.col("stratum") == "pooled")
                & (pl.col("contrast") == "")
                & (pl.col("action") == baseline)
            )
            if model is not None:  # (a comparison with None would be null, not true)
                base = base.filter(pl.col("model") == model)
            base_rows = dict(zip(base["estimand"], base["value"], strict=True))
        for k, (ax, (estimand, (label, scale, unit))) in enumerate(
            zip(row, SWEEP_ESTIMANDS.items(), strict=True)
        ):
            rows = own.filter(pl.col("estimand") == estimand)
            finite = [v for v in rows["value"].to_list() if v is not None and math.isfinite(v)]
            if not finite:
                ax.text(0.5, 0.5, "undefined at every budget\n(no path diverges)", ha="center",
                        va="center", transform=ax.transAxes)  # fmt: skip
            span = (max(budgets) - min(budgets)) * scale_x if len(budgets) > 1 else 1.0
            for j, method in enumerate(methods):
                r = rows.filter(pl.col("method") == method).sort("budget")
                # dodged a little along x so that overlapping intervals stay readable
                x = r["budget"].to_numpy() * scale_x + dodge(j, len(methods), span)
                v, lo, hi = (scale * r[c].to_numpy() for c in ("value", "ci_low", "ci_high"))
                style = styles[method]
                drawn = ax.errorbar(x, v, yerr=[v - lo, hi - v], marker=style.marker, ms=4,
                                    capsize=2.5, **style.line())  # fmt: skip
                drawn.lines[0].set_gid(f"method:{method}")
            value = base_rows.get(estimand)
            if value is not None and math.isfinite(value):
                ax.axhline(scale * value, color="0.35", ls="--", lw=1, zorder=1, gid="baseline")
                drew_baseline = True
            ax.set_xticks([b * scale_x for b in budgets])
            ax.set_xlabel("kept cache, % of the prompt" if fractions else "kept entries (tokens)")
            ax.set_ylabel(label + (", %" if unit == "%" else ", steps"))
            if model is not None and len(models) > 1 and k == 0:
                ax.set_title(str(model))
    handles = [Line2D([], [], marker=styles[m].marker, **styles[m].line()) for m in methods]
    labels = [f"{m} (baseline)" if m == baseline_method else m for m in methods]
    if drew_baseline:
        handles.append(Line2D([], [], color="0.35", ls="--", lw=1))
        labels.append(f"baseline {baseline_label or baseline}")
    level = table["ci_level"][0] if table.height else 0.95
    title = textwrap.fill(f"method (bars: pointwise {100 * level:g}% intervals)", 90)
    figure_legend(fig, handles, labels, title, ncol=min(len(labels), 4))
    return fig


def write_sweep_figure(
    estimands_csv: str | os.PathLike,
    sweep: Mapping[str, tuple[str, float | int]],
    png: str | os.PathLike,
    pdf: str | os.PathLike,
    baseline: str | None = None,
    baseline_label: str | None = None,
) -> pl.DataFrame:
    """A study's sweep figure from its ``estimands.csv``: :func:`plot_sweep` of
    :func:`sweep_table` (by model), written as PNG and PDF; returns the plotted rows. A
    baseline among the swept actions is its method's line, drawn as the baseline's (a paired
    grid: :func:`kvdiverge.config.baselines.baseline_pairs`). An
    action of ``sweep`` absent from the table is a one-line
    :class:`kvdiverge.tables.StudyTableError` naming the file."""
    estimands = read_estimands(estimands_csv)
    present = set(estimands["action"].to_list())
    absent = [a for a in sweep if a not in present]
    if absent:
        raise StudyTableError(
            f"{estimands_csv}: no rows for action {absent[0]!r} (needed by the sweep figure)"
        )
    table = sweep_table(estimands, sweep, by_model=True)
    baseline_method = None
    if baseline is not None and baseline in sweep:  # a paired grid: the baseline's own line
        baseline_method, baseline = sweep[baseline][0], None
    fig = plot_sweep(table, estimands, baseline, baseline_label, baseline_method)
    save_figure(fig, png, pdf)
    return table
