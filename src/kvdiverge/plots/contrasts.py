"""Figures 6 and 7 of a study: the branch endpoints with their intervals, and the gap
decompositions (occurrence, exposure and rate terms) per action (:mod:`kvdiverge.plots.study`
draws the rest and writes them all).

Namesakes by layer: :mod:`kvdiverge.tables.contrasts` tabulates each action minus a baseline,
and :mod:`kvdiverge.compare.contrasts` draws that for ``kvdiverge compare``; this module draws a
study's branch endpoints and gap decompositions.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from kvdiverge.plots.base import (  # noqa: E402
    COLUMN_WIDTH,
    TEXT_WIDTH,
    PercentTicks,
    SeriesStyle,
    figure_legend,
    new_figure,
)
from kvdiverge.plots.study_style import (  # noqa: E402
    _DELTA_R,
    TERM_STYLES,
    _actions_in,
    _complete_styles,
    _fit_limits,
    _interval_values,
    _level_label,
    _models_in,
    _percent,
    note_missing_intervals,
    shown_labels,
)
from kvdiverge.tables import (  # noqa: E402
    StudyTableError,
    contrasts_in,
    require_estimands,
)


def _pooled_action_rows(
    table: pl.DataFrame, estimand: str, actions: Sequence[str], where: str, needed_by: str
) -> pl.DataFrame:
    rows = table.filter(
        (pl.col("estimand") == estimand)
        & (pl.col("stratum") == "pooled")
        & pl.col("action").is_in(actions)
    )
    for model in _models_in(table):
        for action in actions:
            if rows.filter((pl.col("model") == model) & (pl.col("action") == action)).height == 0:
                raise StudyTableError(
                    f"{where}: estimand {estimand!r} missing for model {model!r}, action "
                    f"{action!r} (needed by {needed_by})"
                )
    return rows


def _dodged_intervals(
    ax: plt.Axes,
    rows: pl.DataFrame,
    models: Sequence[str],
    actions: Sequence[str],
    styles: Mapping[str, SeriesStyle],
) -> None:
    width = 0.7 / max(len(actions), 1)
    order = {m: i for i, m in enumerate(models)}
    note_missing_intervals(ax, rows.filter(pl.col("action").is_in(list(actions))))
    for j, action in enumerate(actions):
        offset = (j - (len(actions) - 1) / 2) * width
        r = rows.filter(pl.col("action") == action)
        x = np.array([order[m] for m in r["model"].to_list()]) + offset
        v = r["value"].to_numpy()
        err = np.vstack([v - r["ci_low"].to_numpy(), r["ci_high"].to_numpy() - v])
        style = styles[action]
        ax.errorbar(
            x,
            v,
            yerr=err,
            fmt=style.marker,
            ms=5,
            lw=1.3,
            capsize=3,
            color=style.color,
            mec="white",
            mew=0.5,
            label=action,
        )
    ax.set_xticks(range(len(models)), list(models))
    ax.set_xlim(-0.6, len(models) - 0.4)
    ax.grid(axis="x", visible=False)


def plot_branch_endpoints(
    table: pl.DataFrame,
    actions: Sequence[str] | None = None,
    styles: Mapping[str, SeriesStyle] | None = None,
    where: str = "estimands",
    labels: Mapping[str, str] | None = None,
) -> plt.Figure:
    """Figure 7: branch contrasts B(a) = late − early branch TV (a) and saturation S_.99 (b)
    per model and action, pooled, with the table's (family-adjusted) intervals; both axes are
    fitted to the estimates and their intervals."""
    require_estimands(table, ["branch_contrast_B", "S_99"], where, "figure 7")
    actions = list(actions) if actions is not None else _actions_in(table)
    styles = _complete_styles(styles, actions)
    models = _models_in(table)
    b_rows = _pooled_action_rows(table, "branch_contrast_B", actions, where, "figure 7")
    s_rows = _pooled_action_rows(table, "S_99", actions, where, "figure 7")
    fig, axes = new_figure(TEXT_WIDTH, 2.7, 1, 2)
    ax_b, ax_s = axes[0]
    _dodged_intervals(ax_b, b_rows, models, actions, styles)
    ax_b.axhline(0, color="black", lw=0.8, zorder=0)
    ax_b.set_ylim(*_fit_limits([*_interval_values(b_rows), 0.0], floor=None, ceiling=None))
    _percent(ax_b, "")
    ax_b.set_ylabel("B(a) = late − early branch TV, pp")
    ax_b.set_title(f"(a) branch contrast, {_level_label(b_rows['ci_level'].to_list())} intervals")
    _dodged_intervals(ax_s, s_rows, models, actions, styles)
    ax_s.set_ylim(*_fit_limits(_interval_values(s_rows)))
    _percent(ax_s)
    ax_s.set_ylabel(r"$S_{.99}$: mean over $t$ of $P(\delta_t > .99)$")
    ax_s.set_title(f"(b) saturation, {_level_label(s_rows['ci_level'].to_list())} intervals")
    handles = [
        Line2D([], [], marker=styles[a].marker, lw=1.3, color=styles[a].color, mec="white")
        for a in actions
    ]
    figure_legend(fig, handles, shown_labels(actions, labels), "action", ncol=6)
    return fig


def _covers_zero(row: Mapping) -> bool:
    """Whether the interval of a row covers 0 (or is missing): its shares are then unbounded."""
    lo, hi = row["ci_low"], row["ci_high"]
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return True
    return lo <= 0.0 <= hi


def _stack_span(rows: pl.DataFrame, terms: Sequence[str]) -> float:
    """The height of the decomposition's value axis: from the lowest to the highest end of any
    stacked bar or ΔR_SMC interval (a segment is labelled only when its label fits)."""
    ends = [0.0]
    for (_, _), cell in rows.group_by("model", "contrast"):
        by = {r["estimand"]: r for r in cell.iter_rows(named=True)}
        stack = [by[f"gap_{t}"]["value"] for t in terms if f"gap_{t}" in by]
        ends += [sum(v for v in stack if v > 0), sum(v for v in stack if v < 0)]
        if "R_smc" in by:
            ends += [by["R_smc"]["ci_low"], by["R_smc"]["ci_high"]]
    finite = [e for e in ends if e is not None and math.isfinite(e)]
    return max(max(finite) - min(finite), 1e-12)


def _decomposition_ticks(
    sides: Sequence[Sequence[str]], common: str | None, chars: int
) -> list[str]:
    """Each contrast's tick label: its actions wrapped to ``chars`` (only the minuend where
    every contrast shares the subtrahend ``common``)."""

    def wrap(text: str) -> str:
        return textwrap.fill(text, chars, break_on_hyphens=False)

    if common is not None:
        return [wrap(x[0]) for x in sides]
    return ["\n− ".join(wrap(part) for part in x) for x in sides]


def plot_decomposition(
    table: pl.DataFrame,
    contrasts: Sequence[str] | None = None,
    where: str = "estimands",
    labels: Mapping[str, str] | None = None,
) -> plt.Figure:
    """Decomposition bars: ΔR_SMC = occurrence + exposure + rate terms per contrast and model,
    pooled; stacked hatched terms (positive one way, negative the other), ΔR_SMC with its
    interval as a black marker, and each term's share of ΔR_SMC printed on its segment — only
    where the interval of ΔR_SMC excludes 0 (otherwise the share is unbounded and left out). A
    contrast ``b - a`` is shown by its actions' labels (``labels``, default their names). A few
    short contrasts stand as upright bars side by side; many, or long labels (eight actions
    give 28 pairs), lie as horizontal bars, one row per contrast, so that every label is
    readable in full."""
    terms = tuple(TERM_STYLES)
    need = ["R_smc", *(f"gap_{t}" for t in terms), *(f"{t}_share" for t in terms)]
    require_estimands(table, need, where, "the decomposition figure")
    contrasts = list(contrasts) if contrasts is not None else contrasts_in(table)
    if not contrasts:
        raise StudyTableError(f"{where}: no contrast rows (needed by the decomposition figure)")
    models = _models_in(table)
    rows = table.filter(
        (pl.col("stratum") == "pooled")
        & pl.col("contrast").is_in(contrasts)
        & pl.col("estimand").is_in(need)
    )
    axis_span = _stack_span(rows, terms)
    # a common subtrahend (a baseline) is said once, beside the axis
    sides = [shown_labels(c.split(" - ", 1), labels) for c in contrasts]
    common = sides[0][1] if all(len(x) == 2 and x[1] == sides[0][1] for x in sides) else None
    width = min(TEXT_WIDTH, max(COLUMN_WIDTH, (0.9 + 0.9 * len(contrasts)) * len(models) + 0.7))
    chars = max(8, int((width - 0.8) / len(models) / len(contrasts) * 13))
    ticks = _decomposition_ticks(sides, common, chars)
    tall = max(t.count("\n") + 1 for t in ticks)
    horizontal = len(contrasts) * len(models) > 8 or tall > (4 if common is not None else 6)
    if horizontal:
        chars = 40  # a label of the config's longest fits one line
        ticks = _decomposition_ticks(sides, common, chars)
        rows_in = [0.15 + 0.14 * (t.count("\n") + 1) for t in ticks]
        fig, axes = new_figure(
            TEXT_WIDTH, 1.3 + max(sum(rows_in), 1.4), 1, len(models), sharey=True
        )
    else:
        fig, axes = new_figure(width, 3.1, 1, len(models), sharey=True)
    hidden = False
    for ax, model in zip(axes[0], models, strict=True):
        cell = rows.filter(pl.col("model") == model)
        values = {(r["contrast"], r["estimand"]): r for r in cell.iter_rows(named=True)}
        for i, contrast in enumerate(contrasts):
            for name in need:
                if (contrast, name) not in values:
                    raise StudyTableError(
                        f"{where}: estimand {name!r} missing for model {model!r}, contrast "
                        f"{contrast!r} (needed by the decomposition figure)"
                    )
            hidden |= _decomposition_bar(ax, i, contrast, values, terms, axis_span, horizontal)
        note_missing_intervals(ax, [values[(c, "R_smc")] for c in contrasts])
        ax.use_sticky_edges = False  # a margin beyond 0 too
        if horizontal:
            ax.axvline(0, color="black", lw=0.8, zorder=1)
            ax.margins(x=0.05)
            ax.set_yticks(range(len(contrasts)), ticks)
            ax.set_ylim(len(contrasts) - 0.25, -0.6)  # the first contrast on top
            ax.grid(axis="y", visible=False)
            ax.xaxis.set_major_formatter(PercentTicks(""))
            ax.set_xlabel(f"{_DELTA_R} and its terms, pp")
        else:
            ax.axhline(0, color="black", lw=0.8, zorder=1)
            ax.margins(y=0.05)
            ax.set_xticks(range(len(contrasts)), ticks)
            if common is not None:
                ax.set_xlabel(textwrap.fill(f"each minus {common}", int(chars * len(contrasts))))
            ax.set_xlim(-0.6, len(contrasts) - 0.25)
            ax.grid(axis="x", visible=False)
            _percent(ax, "")
        ax.set_title(model)
    if horizontal:
        if common is not None:
            axes[0][0].set_ylabel(textwrap.fill(f"each minus {common}", 40))
    else:
        axes[0][0].set_ylabel(f"{_DELTA_R} and its terms, pp")
    level = _level_label(rows.filter(pl.col("estimand") == "R_smc")["ci_level"].to_list())
    handles = [
        Patch(facecolor=s.color, hatch=s.hatch, edgecolor="0.25", lw=0.5)
        for s in TERM_STYLES.values()
    ]
    handles.append(Line2D([], [], marker="D", ms=4, color="black", lw=1))
    labels_shown = [f"{t} term" for t in terms] + [f"{_DELTA_R} ({level} interval)"]
    note = "labels: share of " + _DELTA_R
    if hidden:
        note += "\n(not shown where its interval covers 0)"
    figure_legend(fig, handles, labels_shown, note, ncol=2)
    return fig


def _decomposition_bar(
    ax: plt.Axes,
    i: int,
    contrast: str,
    values: Mapping[tuple[str, str], Mapping],
    terms: Sequence[str],
    axis_span: float,
    horizontal: bool,
) -> bool:
    """One contrast's stacked terms, their shares and ΔR_SMC with its interval at slot ``i``;
    returns whether its shares are hidden (its interval covers 0)."""
    total = values[(contrast, "R_smc")]
    show_shares = not _covers_zero(total)
    up, down = 0.0, 0.0
    for term in terms:
        v = values[(contrast, f"gap_{term}")]["value"]
        share = values[(contrast, f"{term}_share")]["value"]
        base = up if v >= 0 else down
        style = TERM_STYLES[term]
        bar = {"color": style.color, "hatch": style.hatch, "edgecolor": "0.25", "lw": 0.5}
        if horizontal:
            ax.barh(i, v, left=base, height=0.6, zorder=2, **bar)
        else:
            ax.bar(i, v, bottom=base, width=0.6, zorder=2, **bar)
        fits = abs(v) >= (0.12 if horizontal else 0.09) * axis_span
        if show_shares and np.isfinite(share) and fits:
            xy = (base + v / 2, i) if horizontal else (i, base + v / 2)
            ax.text(
                *xy,
                f"{100 * share:.0f}%",
                ha="center",
                va="center",
                zorder=3,
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none"},
            )
        if v >= 0:
            up += v
        else:
            down += v
    err = [[total["value"] - total["ci_low"]], [total["ci_high"] - total["value"]]]
    marker = {"fmt": "D", "ms": 4, "color": "black", "capsize": 2.5, "lw": 1, "zorder": 3}
    if horizontal:
        ax.errorbar(total["value"], i + 0.4, xerr=err, **marker)
    else:
        ax.errorbar(i + 0.4, total["value"], yerr=err, **marker)
    return not show_shares
