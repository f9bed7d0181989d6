"""Figures 6 and 7 of a study: the branch endpoints with their intervals, and the gap
decompositions (occurrence, exposure and rate terms) per action (:mod:`kvdiverge.plots.study`
draws the rest and writes them all)."""

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


def plot_decomposition(
    table: pl.DataFrame,
    contrasts: Sequence[str] | None = None,
    where: str = "estimands",
    labels: Mapping[str, str] | None = None,
) -> plt.Figure:
    """Decomposition bars: ΔR_SMC = occurrence + exposure + rate terms per contrast and model,
    pooled; stacked hatched terms (positive up, negative down), ΔR_SMC with its interval as a
    black marker, and each term's share of ΔR_SMC printed on its segment — only where the
    interval of ΔR_SMC excludes 0 (otherwise the share is unbounded and left out). A contrast
    ``b - a`` is shown by its actions' labels (``labels``, default their names)."""
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
    width = min(TEXT_WIDTH, max(COLUMN_WIDTH, (0.9 + 0.9 * len(contrasts)) * len(models) + 0.7))
    fig, axes = new_figure(width, 3.1, 1, len(models), sharey=True)
    axis_span = _stack_span(rows, terms)
    # tick labels wrapped to their slot; a common subtrahend (a baseline) said once, below
    sides = [shown_labels(c.split(" - ", 1), labels) for c in contrasts]
    common = sides[0][1] if all(len(x) == 2 and x[1] == sides[0][1] for x in sides) else None
    chars = max(8, int((width - 0.8) / len(models) / len(contrasts) * 13))

    def wrap(text: str) -> str:
        return textwrap.fill(text, chars, break_on_hyphens=False)

    ticks = [
        wrap(x[0]) if common is not None else "\n− ".join(wrap(part) for part in x) for x in sides
    ]
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
            total = values[(contrast, "R_smc")]
            show_shares = not _covers_zero(total)
            hidden |= not show_shares
            stack = [values[(contrast, f"gap_{t}")]["value"] for t in terms]
            up, down = 0.0, 0.0
            for term, v in zip(terms, stack, strict=True):
                share = values[(contrast, f"{term}_share")]["value"]
                base = up if v >= 0 else down
                style = TERM_STYLES[term]
                ax.bar(
                    i,
                    v,
                    bottom=base,
                    width=0.6,
                    color=style.color,
                    hatch=style.hatch,
                    edgecolor="0.25",
                    lw=0.5,
                    zorder=2,
                )
                if show_shares and np.isfinite(share) and abs(v) >= 0.09 * axis_span:
                    ax.text(
                        i,
                        base + v / 2,
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
            ax.errorbar(
                i + 0.4,
                total["value"],
                yerr=err,
                fmt="D",
                ms=4,
                color="black",
                capsize=2.5,
                lw=1,
                zorder=3,
            )
        note_missing_intervals(ax, [values[(c, "R_smc")] for c in contrasts])
        ax.axhline(0, color="black", lw=0.8, zorder=1)
        ax.use_sticky_edges = False  # a margin beyond 0 too
        ax.margins(y=0.05)
        ax.set_xticks(range(len(contrasts)), ticks)
        if common is not None:
            ax.set_xlabel(textwrap.fill(f"each minus {common}", int(chars * len(contrasts))))
        ax.set_xlim(-0.6, len(contrasts) - 0.25)
        ax.grid(axis="x", visible=False)
        _percent(ax, "")
        ax.set_title(model)
    axes[0][0].set_ylabel(f"{_DELTA_R} and its terms, pp")
    level = _level_label(rows.filter(pl.col("estimand") == "R_smc")["ci_level"].to_list())
    handles = [
        Patch(facecolor=s.color, hatch=s.hatch, edgecolor="0.25", lw=0.5)
        for s in TERM_STYLES.values()
    ]
    handles.append(Line2D([], [], marker="D", ms=4, color="black", lw=1))
    labels = [f"{t} term" for t in terms] + [f"{_DELTA_R} ({level} interval)"]
    note = "labels: share of " + _DELTA_R
    if hidden:
        note += "\n(not shown where its interval covers 0)"
    figure_legend(fig, handles, labels, note, ncol=2)
    return fig
