"""The accuracy figure: task accuracy beside divergence timing, from the long accuracy table.

Panel (a): the accuracy drop X − Y per action (full cache minus the action's cache, paired
document-bootstrap intervals), one row per action (long names wrap). Panel (b): on the paths of each
divergence timing (early τ ≤ d, late d < τ ≤ H, never), the accuracy of the action's generation Y
(filled markers) and of the full cache's X on the same paths (hollow markers), so a reader sees
whether early divergence costs more accuracy than late. A model none of whose generations answers
correctly (every accuracy 0 or undefined, :func:`kvdiverge.tables.accuracy.nothing_answered`)
gets a note in both panels instead of a plot of zeros. Reads only the table written by
:func:`kvdiverge.analysis.accuracy.write_accuracy`, drawn in the house style
(:mod:`kvdiverge.plots.base`) with the study's action styles (:func:`kvdiverge.plots.study.
action_styles`).
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from kvdiverge.plots.base import (  # noqa: E402
    TEXT_WIDTH,
    PercentTicks,
    SeriesStyle,
    empty_panel,
    figure_legend,
    new_figure,
    save_figure,
)
from kvdiverge.plots.study import action_styles  # noqa: E402
from kvdiverge.plots.study_style import note_missing_intervals, shown_labels  # noqa: E402
from kvdiverge.tables import StudyTableError, read_estimands, require_estimands  # noqa: E402
from kvdiverge.tables.accuracy import nothing_answered  # noqa: E402

__all__ = ["plot_accuracy", "write_accuracy_figure"]

_CLASSES = ("early", "late", "never")
_EMPTY_DROP = "no drop to show:\nno generation answers\ncorrectly (accuracy 0%\nunder every cache)"
_EMPTY_TIMING = (
    "{model}: no generation of the full cache or of any action\nanswers correctly "
    "(task accuracy 0% or undefined on every path):\nnothing to compare by divergence timing"
)


def _rows(table: pl.DataFrame, model: str, estimand: str, action: str, where: str) -> dict:
    rows = table.filter(
        (pl.col("model") == model)
        & (pl.col("action") == action)
        & (pl.col("stratum") == "pooled")
        & (pl.col("estimand") == estimand)
    )
    if rows.height == 0:
        raise StudyTableError(
            f"{where}: estimand {estimand!r} missing for model {model!r}, action {action!r} "
            f"(needed by the accuracy figure)"
        )
    return rows.row(0, named=True)


def _point(
    ax: plt.Axes, x: float, row: Mapping, style: SeriesStyle, filled: bool, horizontal: bool = False
) -> None:
    """One estimate with its interval at position ``x`` (on the y axis when ``horizontal``)."""
    v = row["value"]
    if v is None or not np.isfinite(v):
        return
    lo, hi = row["ci_low"], row["ci_high"]
    err = None
    if lo is not None and hi is not None and np.isfinite(lo) and np.isfinite(hi):
        err = [[v - lo], [hi - v]]
    where = {"xerr": err} if horizontal else {"yerr": err}
    ax.errorbar(
        [v] if horizontal else [x],
        [x] if horizontal else [v],
        **where,
        fmt=style.marker,
        ms=5,
        lw=1.1,
        capsize=2.5,
        color=style.color,
        mfc=style.color if filled else "white",
        mec=style.color,
        mew=1.0,
        zorder=3,
    )


def plot_accuracy(
    table: pl.DataFrame,
    actions: Sequence[str] | None = None,
    styles: Mapping[str, SeriesStyle] | None = None,
    where: str = "accuracy",
    labels: Mapping[str, str] | None = None,
) -> plt.Figure:
    """The accuracy figure (module docstring), one row of two panels per model; each action
    shown as its label (``labels``, default its name)."""
    require_estimands(table, ["accuracy_drop", "accuracy_y@early"], where, "the accuracy figure")
    actions = list(actions) if actions is not None else list(dict.fromkeys(table["action"]))
    styles = dict(styles) if styles is not None else action_styles(actions)
    models = list(dict.fromkeys(table["model"]))
    shown = shown_labels(actions, labels)
    wrapped = [textwrap.fill(a, 24, break_on_hyphens=False) for a in shown]
    lines = sum(w.count("\n") + 1 for w in wrapped)
    fig, axes = new_figure(
        TEXT_WIDTH,
        max(2.5, 0.9 + 0.2 * lines + 0.08 * len(actions)) * len(models),
        len(models),
        2,
        gridspec_kw={"width_ratios": [1, 2]},
    )
    width = 0.7 / max(len(actions), 1)
    empty = {m for m in models if nothing_answered(table, m, actions)}
    for i, model in enumerate(models):
        ax_a, ax_b = axes[i]
        suffix = f", {model}" if len(models) > 1 else ""
        if model in empty:  # nothing to draw: say so instead of plotting zeros
            empty_panel(ax_a, _EMPTY_DROP, "accuracy drop X − Y, pp")
            empty_panel(ax_b, _EMPTY_TIMING.format(model=model), "divergence within H")
            ax_a.set_title(f"(a) drop against the full cache{suffix}")
            ax_b.set_title(f"(b) accuracy by divergence timing{suffix}")
            continue
        drops = [_rows(table, model, "accuracy_drop", a, where) for a in actions]
        for j, action in enumerate(actions):
            _point(ax_a, j, drops[j], styles[action], True, horizontal=True)
        note_missing_intervals(ax_a, drops)
        ax_a.axvline(0, color="black", lw=0.8, zorder=1)
        ax_a.set_yticks(range(len(actions)), wrapped)
        ax_a.set_ylim(len(actions) - 0.4, -0.6)
        ax_a.grid(axis="y", visible=False)
        ax_a.xaxis.set_major_formatter(PercentTicks(""))
        ax_a.xaxis.set_major_locator(MaxNLocator(4))
        ax_a.set_xlabel("accuracy drop X − Y, pp")
        ax_a.set_title(f"(a) drop against the full cache{suffix}")
        for k, cls in enumerate(_CLASSES):
            for j, action in enumerate(actions):
                x = k + (j - (len(actions) - 1) / 2) * width
                style = styles[action]
                y_row = _rows(table, model, f"accuracy_y@{cls}", action, where)
                x_row = _rows(table, model, f"accuracy_x@{cls}", action, where)
                _point(ax_b, x - width * 0.18, x_row, style, False)
                _point(ax_b, x + width * 0.18, y_row, style, True)
        share = {
            cls: [_rows(table, model, f"share@{cls}", a, where)["value"] for a in actions]
            for cls in _CLASSES
        }
        labels = [
            f"{cls}\n({100 * float(np.nanmean(share[cls])):.0f}% of paths)" for cls in _CLASSES
        ]
        ax_b.set_xticks(range(len(_CLASSES)), labels)
        ax_b.set_xlim(-0.6, len(_CLASSES) - 0.4)
        ax_b.set_ylim(-0.04, 1.04)
        ax_b.grid(axis="x", visible=False)
        ax_b.yaxis.set_major_formatter(PercentTicks())
        ax_b.set_ylabel("task accuracy")
        ax_b.set_xlabel("divergence within H (share: mean over actions)")
        ax_b.set_title(f"(b) accuracy by divergence timing{suffix}")
    if len(empty) == len(models):
        return fig  # no series drawn: no legend
    level = sorted({round(float(v), 10) for v in table["ci_level"].to_list()})
    handles = [
        Line2D([], [], marker=styles[a].marker, lw=0, color=styles[a].color, mec=styles[a].color)
        for a in actions
    ]
    handles += [
        Line2D([], [], marker="o", lw=0, color="0.3", mfc="0.3"),
        Line2D([], [], marker="o", lw=0, color="0.3", mfc="white"),
    ]
    legend_labels = [*shown, "Y (action)", "X (full cache)"]
    title = f"{'/'.join(f'{100 * v:.10g}%' for v in level)} document-bootstrap intervals"
    figure_legend(fig, handles, legend_labels, title, ncol=min(len(legend_labels), 6))
    return fig


def write_accuracy_figure(
    accuracy_csv: str | os.PathLike,
    png: str | os.PathLike,
    pdf: str | os.PathLike,
    actions: Sequence[str] | None = None,
    palette_actions: Sequence[str] | None = None,
    control: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> None:
    """Draw :func:`plot_accuracy` from the accuracy CSV and write it as PNG and PDF; actions
    take the styles of the study's figures (``palette_actions`` order, ``control`` grey) and
    show their ``labels``."""
    table = read_estimands(accuracy_csv)
    plotted = list(actions) if actions is not None else list(dict.fromkeys(table["action"]))
    styles = action_styles(list(palette_actions or plotted), control)
    save_figure(plot_accuracy(table, plotted, styles, str(accuracy_csv), labels), png, pdf)
