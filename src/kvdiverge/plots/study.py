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
import polars as pl  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from kvdiverge.plots.base import (  # noqa: E402
    COLUMN_WIDTH,
    TEXT_WIDTH,
    SeriesStyle,
    interval_band,
    new_figure,
    save_figure,
)
from kvdiverge.plots.contrasts import plot_branch_endpoints, plot_decomposition  # noqa: E402
from kvdiverge.plots.study_style import (  # noqa: E402
    TERM_STYLES,
    _action_legend,
    _actions_in,
    _complete_styles,
    _fit_limits,
    _interval_values,
    _level_label,
    _models_in,
    _percent,
    _require_profile,
    action_styles,
    branch_windows,
    note_missing_intervals,
    profile,
)
from kvdiverge.tables import (  # noqa: E402
    StudyTableError,
    read_estimands,
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
    and ``needed_by``. Rows resting on fewer than two documents draw no band, and the panel
    says so (:func:`note_missing_intervals`)."""
    note_missing_intervals(ax, panel.filter(pl.col("action").is_in(list(actions))))
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
    labels: Mapping[str, str] | None = None,
) -> plt.Figure:
    """Figure 5: the divergence CDF P(τ ≤ t), all strata pooled, one panel per model, one line
    per action (shown as its label, ``labels``), with the table's pointwise intervals as
    outlined bands. One column wide; the per-stratum curves are
    :func:`plot_divergence_cdf_strata`."""
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
    _action_legend(
        fig, actions, styles, f"action (bands: pointwise {level} intervals)", labels, ncol=3
    )
    return fig


def plot_divergence_cdf_strata(
    table: pl.DataFrame,
    actions: Sequence[str] | None = None,
    styles: Mapping[str, SeriesStyle] | None = None,
    where: str = "estimands",
    labels: Mapping[str, str] | None = None,
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
    _action_legend(
        fig, actions, styles, f"action (bands: pointwise {level} intervals)", labels, ncol=6
    )
    return fig


def plot_tv_profiles(
    table: pl.DataFrame,
    actions: Sequence[str] | None = None,
    styles: Mapping[str, SeriesStyle] | None = None,
    where: str = "estimands",
    labels: Mapping[str, str] | None = None,
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
    _action_legend(
        fig, actions, styles, f"action (bands: pointwise {level} intervals)", labels, ncol=6
    )
    return fig


def write_study_figures(
    estimands_csv: str | os.PathLike,
    outputs: Mapping[str, tuple[str | os.PathLike, str | os.PathLike]],
    actions: Sequence[str] | None = None,
    palette_actions: Sequence[str] | None = None,
    control: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> None:
    """Draw the requested study figures from ``estimands.csv`` and write each as PNG and PDF.

    ``outputs`` maps names of :data:`FIGURES` to (png, pdf) paths; ``actions`` are the plotted
    actions (default: all in the table; pass the study's compared actions to leave out the
    control); ``palette_actions`` fixes the order in which actions take their styles (default:
    ``actions``, so that a study's first two actions are the high-contrast pair; ``control`` is
    drawn grey and takes no position); ``labels``: what legends and tick labels show for each
    action (its ``config.actions.<name>.label``; default its name). Every figure is drawn
    before any file is written, so a missing estimand leaves no partial output.
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
        "fig5_divergence_cdf": lambda: plot_divergence_cdf(table, plotted, styles, where, labels),
        "fig5_divergence_cdf_strata": lambda: plot_divergence_cdf_strata(
            table, plotted, styles, where, labels
        ),
        "fig6_tv_profiles": lambda: plot_tv_profiles(table, plotted, styles, where, labels),
        "fig7_branch_contrasts": lambda: plot_branch_endpoints(
            table, plotted, styles, where, labels
        ),
        "decomposition": lambda: plot_decomposition(table, None, where, labels),
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
