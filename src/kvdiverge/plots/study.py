"""Figures of the language-model study: figure 5 (pooled, and per stratum for an appendix),
figures 6–7 and the decomposition bars.

Every figure reads only the long estimands table (``estimands.csv``, read by
:func:`kvdiverge.tables.read_estimands`) — any study's — and draws the intervals stored there
(``ci_low``/``ci_high`` at ``ci_level``); nothing is re-estimated. Profiles are the estimands
named ``name@x`` (``div_cdf@t``, ``tv@t``, ``branch_tv@j``), so the horizon and the branch depth
come from the table. A figure whose estimands are absent raises
:class:`kvdiverge.tables.StudyTableError` naming the estimand and the file.

Every figure is drawn in the house style of :mod:`kvdiverge.plots.base` at its print size
(figure 5 at one column's width, the others at the text width). Actions keep one
:class:`~kvdiverge.plots.base.SeriesStyle` (colour, line style, marker) in all figures of a
study, by their order in the study; pointwise intervals are light bands with thin edges in the
action's colour and line style; fractions are drawn on percent axes whose ticks are never
rounded (:class:`~kvdiverge.plots.base.PercentTicks`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from kvdiverge.plots.base import (  # noqa: E402
    COLUMN_WIDTH,
    TEXT_WIDTH,
    PercentTicks,
    SeriesStyle,
    figure_legend,
    interval_band,
    new_figure,
    save_figure,
    series_styles,
)
from kvdiverge.tables import (  # noqa: E402
    StudyTableError,
    contrasts_in,
    read_estimands,
    require_estimands,
    strata_in,
    stratum_label,
)

__all__ = [
    "FIGURES",
    "TERM_STYLES",
    "action_styles",
    "branch_windows",
    "plot_branch_endpoints",
    "plot_decomposition",
    "plot_divergence_cdf",
    "plot_divergence_cdf_strata",
    "plot_tv_profiles",
    "profile",
    "write_study_figures",
]

FIGURES = (
    "fig5_divergence_cdf",
    "fig5_divergence_cdf_strata",
    "fig6_tv_profiles",
    "fig7_branch_contrasts",
    "decomposition",
)
TERM_STYLES = {
    "occurrence": SeriesStyle("#E69F00", hatch=""),
    "exposure": SeriesStyle("#56B4E9", hatch="////"),
    "rate": SeriesStyle("#CC79A7", hatch="...."),
}
"""The decomposition's terms: colour and hatch (distinct from the actions' colours)."""
_DELTA_R = r"$\Delta R_{\mathrm{SMC}}$"


def action_styles(actions: Sequence[str], control: str | None = None) -> dict[str, SeriesStyle]:
    """One style per action by its position in ``actions`` (the study's order: its first two
    actions are the high-contrast blue/vermillion pair); the full-retention control is grey
    and dotted (:func:`kvdiverge.plots.base.series_styles`)."""
    return series_styles(actions, control)


def _actions_in(table: pl.DataFrame) -> list[str]:
    return [a for a in table["action"].unique(maintain_order=True).to_list() if a]


def _models_in(table: pl.DataFrame) -> list[str]:
    return table["model"].unique(maintain_order=True).to_list()


def _complete_styles(styles: Mapping[str, SeriesStyle] | None, actions: Sequence[str]) -> dict:
    """``styles`` extended with styles for the actions it lacks (after those it has)."""
    styles = dict(styles or {})
    missing = [a for a in actions if a not in styles]
    if missing:
        extra = series_styles([*styles, *missing])
        styles |= {a: extra[a] for a in missing}
    return styles


def profile(table: pl.DataFrame, prefix: str) -> pl.DataFrame:
    """Rows of a profile (``div_cdf@t``, ``tv@t``, ``branch_tv@j``: estimands named
    ``prefix@x``) with ``x`` (int) as a column, sorted by x."""
    marker = f"{prefix}@"
    rows = table.filter(pl.col("estimand").str.starts_with(marker))
    return (
        rows.with_columns(x=pl.col("estimand").str.slice(len(marker)).cast(pl.Int64, strict=False))
        .filter(pl.col("x").is_not_null())
        .sort("x")
    )


def _require_profile(table: pl.DataFrame, prefix: str, where: str, needed_by: str) -> pl.DataFrame:
    rows = profile(table, prefix)
    if rows.height == 0:
        raise StudyTableError(
            f"{where}: estimand {prefix + '@1'!r} missing (needed by {needed_by})"
        )
    return rows


def branch_windows(table: pl.DataFrame, where: str = "estimands") -> tuple[range, range]:
    """Early and late lag windows of the divergence clock, recovered from the table.

    The window w is the one for which ``branch_early`` = mean of ``branch_tv@1..w`` and
    ``branch_late`` = mean of ``branch_tv@d−w+1..d`` (d the deepest lag) on every pooled action
    row with finite values — these identities hold exactly by construction of the estimands.
    """
    require_estimands(table, ["branch_early", "branch_late"], where, "the branch windows")
    lags = _require_profile(table, "branch_tv", where, "the branch windows")
    pooled = lags.filter((pl.col("stratum") == "pooled") & (pl.col("action") != ""))
    depth = int(pooled["x"].max())
    wide = pooled.pivot(on="x", index=["model", "action"], values="value", sort_columns=False)
    keys = ["model", "action"]
    ends = table.filter(
        (pl.col("stratum") == "pooled")
        & (pl.col("action") != "")
        & pl.col("estimand").is_in(["branch_early", "branch_late"])
    ).pivot(on="estimand", index=keys, values="value")
    joined = wide.join(ends, on=keys)
    b = joined.select([str(j) for j in range(1, depth + 1)]).to_numpy()
    early, late = joined["branch_early"].to_numpy(), joined["branch_late"].to_numpy()
    usable = np.isfinite(b).all(1) & np.isfinite(early) & np.isfinite(late)
    b, early, late = b[usable], early[usable], late[usable]
    fits = []
    for w in range(1, depth // 2 + 1):
        ok_early = np.allclose(b[:, :w].mean(1), early, rtol=1e-9, atol=1e-12)
        ok_late = np.allclose(b[:, depth - w :].mean(1), late, rtol=1e-9, atol=1e-12)
        if ok_early and ok_late:
            fits.append(w)
    if not fits:
        raise StudyTableError(
            f"{where}: branch_early/branch_late are not window means of branch_tv@j for any "
            f"window 1..{depth // 2}"
        )
    default = max(1, round(depth / 4))  # 16 of 64 lags, when flat profiles tie
    w = fits[0] if len(fits) == 1 or default not in fits else default
    return range(1, w + 1), range(depth - w + 1, depth + 1)


def _level_label(levels: Sequence[float]) -> str:
    found = sorted({round(float(v), 10) for v in levels if v is not None and np.isfinite(v)})
    return "/".join(f"{100 * v:.10g}%" for v in found) if found else "unstated"


def _fit_limits(
    values: Sequence[float] | np.ndarray,
    floor: float | None = 0.0,
    ceiling: float | None = 1.0,
    pad: float = 0.06,
) -> tuple[float, float]:
    """Axis limits fitted to ``values`` (the plotted values and interval ends): from ``floor``
    when nothing lies below it, up to the largest value plus a margin, never past ``ceiling``
    by more than the margin."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    if v.size == 0:
        return (floor if floor is not None else 0.0, ceiling if ceiling is not None else 1.0)
    lo, hi = float(v.min()), float(v.max())
    if floor is not None and lo >= floor:
        lo = floor
    if hi - lo < 1e-9:  # one value (all zero, say): a window of 5 points above or around it
        half = max(abs(hi), 0.05) / 2
        lo, hi = (lo, lo + 2 * half) if lo == floor else (lo - half, hi + half)
    span = hi - lo
    low = lo - (0.02 if floor is not None and lo == floor else pad) * span
    high = hi + pad * span
    if ceiling is not None:
        high = min(high, ceiling + 0.02 * span)
    return low, high


def _percent(ax: plt.Axes, symbol: str = "%") -> None:
    ax.yaxis.set_major_formatter(PercentTicks(symbol))


def _action_legend(
    fig: plt.Figure, actions: Sequence[str], styles: Mapping[str, SeriesStyle], title: str, **kw
) -> None:
    handles = [Line2D([], [], lw=1.6, **styles[a].line()) for a in actions]
    figure_legend(fig, handles, list(actions), title, **kw)


def _profile_lines(
    ax: plt.Axes,
    panel: pl.DataFrame,
    actions: Sequence[str],
    styles: Mapping[str, SeriesStyle],
    context: str,
    needed_by: str,
    step: bool = False,
) -> None:
    """One panel of profiles against ``x``: each action's pointwise band (light fill, thin
    edges), then its line (steps for a CDF). An absent action is an error naming ``context``
    and ``needed_by``."""
    for action in actions:
        r = panel.filter(pl.col("action") == action)
        if r.height == 0:
            raise StudyTableError(f"{context}: action {action!r} missing (needed by {needed_by})")
        x = r["x"].to_numpy()
        interval_band(ax, x, r["ci_low"].to_numpy(), r["ci_high"].to_numpy(), styles[action], step)
    for action in actions:
        r = panel.filter(pl.col("action") == action)
        ax.plot(
            r["x"].to_numpy(),
            r["value"].to_numpy(),
            lw=1.5,
            drawstyle="steps-post" if step else "default",
            zorder=2,
            **styles[action].line(),
        )


def _interval_values(rows: pl.DataFrame) -> np.ndarray:
    return rows.select("value", "ci_low", "ci_high").to_numpy().ravel()


def _cdf_rows(
    table: pl.DataFrame, actions: Sequence[str], where: str, needed_by: str
) -> pl.DataFrame:
    rows = _require_profile(table, "div_cdf", where, needed_by)
    return rows.filter(pl.col("action").is_in(actions))


def _cdf_axes(ax: plt.Axes, horizon: int, limits: tuple[float, float]) -> None:
    ax.set_xlim(1, horizon)
    ax.set_ylim(*limits)
    ax.xaxis.set_major_locator(MaxNLocator(5, integer=True))
    _percent(ax)


def plot_divergence_cdf(
    table: pl.DataFrame,
    actions: Sequence[str] | None = None,
    styles: Mapping[str, SeriesStyle] | None = None,
    where: str = "estimands",
) -> plt.Figure:
    """Figure 5: the divergence CDF P(τ ≤ t), all strata pooled, one panel per model, one line
    per action, with the table's pointwise intervals as outlined bands. One column wide; the
    per-stratum curves are :func:`plot_divergence_cdf_strata`."""
    actions = list(actions) if actions is not None else _actions_in(table)
    styles = _complete_styles(styles, actions)
    rows = _cdf_rows(table, actions, where, "figure 5")
    pooled = rows.filter(pl.col("stratum") == "pooled")
    models = _models_in(table)
    horizon = int(rows["x"].max())
    limits = _fit_limits(_interval_values(pooled))
    fig, axes = new_figure(
        COLUMN_WIDTH, 0.8 + 1.6 * len(models), len(models), 1, sharex=True, sharey=True
    )
    for i, model in enumerate(models):
        ax = axes[i][0]
        panel = pooled.filter(pl.col("model") == model)
        context = f"{where}: estimand 'div_cdf@t' of model {model!r}, stratum 'pooled'"
        _profile_lines(ax, panel, actions, styles, context, "figure 5", step=True)
        _cdf_axes(ax, horizon, limits)
        ax.set_title(f"{model}, all strata pooled")
        ax.set_ylabel(r"$P(\tau \leq t)$")
    axes[-1][0].set_xlabel("generation step $t$")
    level = _level_label(pooled["ci_level"].to_list())
    _action_legend(fig, actions, styles, f"action (bands: pointwise {level} intervals)", ncol=3)
    return fig


def plot_divergence_cdf_strata(
    table: pl.DataFrame,
    actions: Sequence[str] | None = None,
    styles: Mapping[str, SeriesStyle] | None = None,
    where: str = "estimands",
) -> plt.Figure:
    """Figure 5 per stratum (appendix): the divergence CDF of every model (columns) and stratum
    (rows), drawn as :func:`plot_divergence_cdf` draws the pooled curves; the text width wide.
    A single model's strata wrap into three columns."""
    needed_by = "figure 5 per stratum"
    actions = list(actions) if actions is not None else _actions_in(table)
    styles = _complete_styles(styles, actions)
    rows = _cdf_rows(table, actions, where, needed_by)
    strata = strata_in(table)
    if not strata:
        raise StudyTableError(f"{where}: no per-stratum rows (needed by {needed_by})")
    models = _models_in(table)
    if len(models) > 1:
        panels = [(m, s) for s in strata for m in models]
        ncols = len(models)
    else:
        panels = [(models[0], s) for s in strata]
        ncols = min(3, len(strata))
    nrows = math.ceil(len(panels) / ncols)
    horizon = int(rows["x"].max())
    shown = rows.filter(pl.col("stratum") != "pooled")
    limits = _fit_limits(_interval_values(shown))
    fig, axes = new_figure(TEXT_WIDTH, 0.8 + 1.4 * nrows, nrows, ncols, sharex=True, sharey=True)
    flat = axes.ravel()
    for k, (model, stratum) in enumerate(panels):
        ax = flat[k]
        panel = shown.filter((pl.col("model") == model) & (pl.col("stratum") == stratum))
        context = f"{where}: estimand 'div_cdf@t' of model {model!r}, stratum {stratum!r}"
        _profile_lines(ax, panel, actions, styles, context, needed_by, step=True)
        _cdf_axes(ax, horizon, limits)
        ax.set_title(f"{model} · {stratum_label(stratum)}")
        ax.set_ylabel(r"$P(\tau \leq t)$" if k % ncols == 0 else "")
        ax.set_xlabel("generation step $t$" if k >= len(panels) - ncols else "")
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    level = _level_label(shown["ci_level"].to_list())
    _action_legend(fig, actions, styles, f"action (bands: pointwise {level} intervals)", ncol=6)
    return fig


def plot_tv_profiles(
    table: pl.DataFrame,
    actions: Sequence[str] | None = None,
    styles: Mapping[str, SeriesStyle] | None = None,
    where: str = "estimands",
) -> plt.Figure:
    """Figure 6: generation-clock E[δ_t] (left) and divergence-clock branch TV b_j =
    E[δ_{τ+j} | τ ≤ d] (right) per model (rows), pooled, with pointwise intervals; the
    generation-clock blocks are marked and the early and late lag windows shaded."""
    gen = _require_profile(table, "tv", where, "figure 6")
    branch = _require_profile(table, "branch_tv", where, "figure 6")
    early, late = branch_windows(table, where)
    depth = int(branch["x"].max())
    edges = sorted(
        {
            int(name.split("@")[1].split(":")[1])
            for name in table["estimand"].unique().to_list()
            if name.startswith("block_tv@") and ":" in name
        }
    )
    actions = list(actions) if actions is not None else _actions_in(table)
    styles = _complete_styles(styles, actions)
    models = _models_in(table)
    shown = [
        rows.filter((pl.col("stratum") == "pooled") & pl.col("action").is_in(actions))
        for rows in (gen, branch)
    ]
    limits = _fit_limits(_interval_values(pl.concat(shown)))
    fig, axes = new_figure(TEXT_WIDTH, 0.8 + 1.9 * len(models), len(models), 2, sharey=True)
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    for i, model in enumerate(models):
        for k, (rows, xlabel, title, ylabel) in enumerate(
            (
                (
                    shown[0],
                    "generation step $t$",
                    "generation clock",
                    r"mean rollout TV $E[\delta_t]$",
                ),
                (
                    shown[1],
                    r"lag $j$ after first divergence $\tau$",
                    "divergence clock",
                    rf"branch TV $E[\delta_{{\tau+j}} \mid \tau \leq {depth}]$",
                ),
            )
        ):
            ax = axes[i][k]
            panel = rows.filter(pl.col("model") == model)
            if k == 1:
                for window, name in ((early, "early"), (late, "late")):
                    ax.axvspan(window.start - 0.5, window.stop - 0.5, color="0.92", zorder=0)
                    ax.text(
                        (window.start + window.stop - 1) / 2,
                        0.97,
                        name,
                        ha="center",
                        va="top",
                        transform=ax.get_xaxis_transform(),
                    )
            else:
                for edge in edges[:-1]:
                    ax.axvline(edge + 0.5, color="0.55", lw=0.7, ls=":", zorder=0)
            context = f"{where}: profile of model {model!r}"
            _profile_lines(ax, panel, actions, styles, context, "figure 6")
            ax.set_xlim(0.5 if k == 1 else 1, int(rows["x"].max()) + (0.5 if k == 1 else 0))
            ax.set_ylim(*limits)
            ax.tick_params(labelleft=True)
            _percent(ax)
            ax.set_xlabel(xlabel if i == len(models) - 1 else "")
            ax.set_ylabel(ylabel)
            ax.set_title(f"({next(letters)}) {model}: {title}")
    level = _level_label(pl.concat(shown)["ci_level"].to_list())
    _action_legend(fig, actions, styles, f"action (bands: pointwise {level} intervals)", ncol=6)
    return fig


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
    figure_legend(fig, handles, list(actions), "action", ncol=6)
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
) -> plt.Figure:
    """Decomposition bars: ΔR_SMC = occurrence + exposure + rate terms per contrast and model,
    pooled; stacked hatched terms (positive up, negative down), ΔR_SMC with its interval as a
    black marker, and each term's share of ΔR_SMC printed on its segment — only where the
    interval of ΔR_SMC excludes 0 (otherwise the share is unbounded and left out)."""
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
        ax.axhline(0, color="black", lw=0.8, zorder=1)
        ax.use_sticky_edges = False  # a margin beyond 0 too
        ax.margins(y=0.05)
        ax.set_xticks(range(len(contrasts)), [c.replace(" - ", "\n− ") for c in contrasts])
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


def write_study_figures(
    estimands_csv: str | os.PathLike,
    outputs: Mapping[str, tuple[str | os.PathLike, str | os.PathLike]],
    actions: Sequence[str] | None = None,
    palette_actions: Sequence[str] | None = None,
    control: str | None = None,
) -> None:
    """Draw the requested study figures from ``estimands.csv`` and write each as PNG and PDF.

    ``outputs`` maps names of :data:`FIGURES` to (png, pdf) paths; ``actions`` are the plotted
    actions (default: all in the table; pass the study's compared actions to leave out the
    control); ``palette_actions`` fixes the order in which actions take their styles (default:
    ``actions``, so that a study's first two actions are the high-contrast pair; ``control`` is
    drawn grey and takes no position). Every figure is drawn before any file is written, so a
    missing estimand leaves no partial output.
    """
    unknown = sorted(set(outputs) - set(FIGURES))
    if unknown:
        raise StudyTableError(f"outputs: unknown figure(s) {', '.join(unknown)}")
    where = str(estimands_csv)
    table = read_estimands(estimands_csv)
    present = set(_actions_in(table))
    if actions is not None:
        absent = [a for a in actions if a not in present]
        if absent:
            raise StudyTableError(f"{where}: no rows for action {absent[0]!r}")
    plotted = list(actions) if actions is not None else _actions_in(table)
    styles = action_styles(list(palette_actions or plotted), control)
    draw = {
        "fig5_divergence_cdf": lambda: plot_divergence_cdf(table, plotted, styles, where),
        "fig5_divergence_cdf_strata": lambda: plot_divergence_cdf_strata(
            table, plotted, styles, where
        ),
        "fig6_tv_profiles": lambda: plot_tv_profiles(table, plotted, styles, where),
        "fig7_branch_contrasts": lambda: plot_branch_endpoints(table, plotted, styles, where),
        "decomposition": lambda: plot_decomposition(table, None, where),
    }
    figures = {}
    try:
        for name in outputs:
            figures[name] = draw[name]()
    except Exception:
        for fig in figures.values():
            plt.close(fig)
        raise
    for name, (png, pdf) in outputs.items():
        save_figure(figures[name], png, pdf)
