"""Figures of the language-model study (SPEC §5, paper §5: figures 5–7 and decomposition bars).

Every figure reads only the long estimands table (DESIGN §3.4) — any study's — and draws the
intervals stored there (``ci_low``/``ci_high`` at ``ci_level``); nothing is re-estimated.
Profiles are the estimands named ``name@x`` (``div_cdf@t``, ``tv@t``, ``branch_tv@j``), so the
horizon and the branch depth come from the table. A figure whose estimands are absent raises
:class:`kvdiverge.tables.StudyTableError` naming the estimand and the file.

Actions keep one colour across all figures (:func:`action_palette`, keyed by the configured
action list); fractions are drawn on percent axes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.ticker import MaxNLocator, PercentFormatter  # noqa: E402

from kvdiverge.plots.base import paper_theme, save_figure  # noqa: E402
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
    "action_palette",
    "branch_windows",
    "plot_branch_endpoints",
    "plot_decomposition",
    "plot_divergence_cdf",
    "plot_tv_profiles",
    "profile",
    "write_study_figures",
]

FIGURES = ("fig5_divergence_cdf", "fig6_tv_profiles", "fig7_branch_contrasts", "decomposition")
_CONTROL_COLOR = (0.45, 0.45, 0.45)
_TERM_COLORS = {"occurrence": "#e6ab02", "exposure": "#1b9e77", "rate": "#7570b3"}
_PERCENT = PercentFormatter(xmax=1.0, decimals=0)
_POINTS = PercentFormatter(xmax=1.0, decimals=0, symbol="")  # percentage points: "12"
_DELTA_R = r"$\Delta R_{\mathrm{SMC}}$"


def _colors(n: int) -> list[tuple]:
    """``n`` distinct colour-blind-safe colours; grey is left for the control."""
    base = sns.color_palette("colorblind", 10)
    order = [0, 1, 2, 4, 5, 8, 9, 3, 6]
    return [tuple(base[order[i % len(order)]]) for i in range(n)]


def action_palette(actions: Sequence[str], control: str | None = None) -> dict[str, tuple]:
    """One colour per eviction action (SPEC §5), by position in ``actions`` (pass every
    configured action so that an action has the same colour in every study and figure); the
    full-retention control is grey."""
    compared = [a for a in actions if a != control]
    palette = dict(zip(compared, _colors(len(compared)), strict=True))
    if control is not None:
        palette[control] = _CONTROL_COLOR
    return palette


def _actions_in(table: pl.DataFrame) -> list[str]:
    return [a for a in table["action"].unique(maintain_order=True).to_list() if a]


def _models_in(table: pl.DataFrame) -> list[str]:
    return table["model"].unique(maintain_order=True).to_list()


def _complete_palette(palette: Mapping[str, tuple] | None, actions: Sequence[str]) -> dict:
    """``palette`` extended with colours for actions it lacks."""
    palette = dict(palette or {})
    missing = [a for a in actions if a not in palette]
    if missing:
        start = len(palette)
        extra = _colors(start + len(missing))
        for i, a in enumerate(missing):
            palette[a] = extra[start + i]
    return palette


def profile(table: pl.DataFrame, prefix: str) -> pl.DataFrame:
    """Rows of a SPEC §5 profile (``div_cdf@t``, ``tv@t``, ``branch_tv@j``: estimands named
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
    """Early and late lag windows of the divergence clock, recovered from the table (SPEC §5).

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
    default = max(1, round(depth / 4))  # SPEC §5: 16 of 64 lags, when flat profiles tie
    w = fits[0] if len(fits) == 1 or default not in fits else default
    return range(1, w + 1), range(depth - w + 1, depth + 1)


def _band(ax: plt.Axes, x, low, high, color, step: bool = False) -> None:
    ax.fill_between(
        x, low, high, color=color, alpha=0.2, lw=0, step="post" if step else None, zorder=1
    )


def _profile_facet(
    ax: plt.Axes,
    panel: pl.DataFrame,
    actions: Sequence[str],
    palette: Mapping[str, tuple],
    context: str,
    needed_by: str,
    step: bool = False,
) -> None:
    """One facet of profiles against ``x``: each action's pointwise band, then its line
    (steps for a CDF). An absent action is an error naming ``context`` and ``needed_by``."""
    for action in actions:
        r = panel.filter(pl.col("action") == action)
        if r.height == 0:
            raise StudyTableError(f"{context}: action {action!r} missing (needed by {needed_by})")
        low, high = r["ci_low"].to_numpy(), r["ci_high"].to_numpy()
        _band(ax, r["x"].to_numpy(), low, high, palette[action], step)
    sns.lineplot(
        data=panel.to_pandas(),
        x="x",
        y="value",
        hue="action",
        hue_order=actions,
        palette=palette,
        lw=1.3,
        ax=ax,
        legend=False,
        zorder=2,
        **({"drawstyle": "steps-post"} if step else {}),
    )
    ax.set_ylim(-0.02, 1.02)
    _percent_axis(ax)


def _percent_axis(ax: plt.Axes, axis: str = "y") -> None:
    (ax.yaxis if axis == "y" else ax.xaxis).set_major_formatter(_PERCENT)


def _level_label(levels: Sequence[float]) -> str:
    found = sorted({round(float(v), 10) for v in levels if v is not None and np.isfinite(v)})
    return "/".join(f"{100 * v:.10g}%" for v in found) if found else "unstated"


def _legend(fig: plt.Figure, actions: Sequence[str], palette: Mapping, title: str) -> None:
    handles = [plt.Line2D([], [], color=palette[a], lw=2) for a in actions]
    fig.legend(
        handles,
        list(actions),
        loc="lower center",
        ncol=min(len(actions), 6),
        frameon=False,
        title=title,
        fontsize=8,
        title_fontsize=8,
    )


def plot_divergence_cdf(
    table: pl.DataFrame,
    actions: Sequence[str] | None = None,
    palette: Mapping[str, tuple] | None = None,
    where: str = "estimands",
) -> plt.Figure:
    """Figure 5: divergence CDF P(τ ≤ t) per model (rows) and action (colour), pooled and per
    stratum (columns), with the table's pointwise intervals as bands (SPEC §2, §5)."""
    rows = _require_profile(table, "div_cdf", where, "figure 5")
    actions = list(actions) if actions is not None else _actions_in(table)
    palette = _complete_palette(palette, actions)
    models = _models_in(table)
    columns = ["pooled", *strata_in(table)]
    rows = rows.filter(pl.col("action").is_in(actions))
    horizon = int(rows["x"].max())
    paper_theme()
    fig, axes = plt.subplots(
        len(models),
        len(columns),
        figsize=(2.2 * len(columns) + 0.6, 2.2 * len(models) + 0.8),
        sharex=True,
        sharey=True,
        squeeze=False,
    )
    for i, model in enumerate(models):
        for k, stratum in enumerate(columns):
            ax = axes[i][k]
            panel = rows.filter((pl.col("model") == model) & (pl.col("stratum") == stratum))
            context = f"{where}: estimand 'div_cdf@t' of model {model!r}, stratum {stratum!r}"
            _profile_facet(ax, panel, actions, palette, context, "figure 5", step=True)
            ax.set_xlim(1, horizon)
            ax.xaxis.set_major_locator(MaxNLocator(4, integer=True))
            ax.set_title(f"{model} · {stratum_label(stratum)}", fontsize=8)
            ax.set_xlabel("generation step $t$" if i == len(models) - 1 else "")
            ax.set_ylabel(r"$P(\tau \leq t)$" if k == 0 else "")
    level = _level_label(rows["ci_level"].to_list())
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    _legend(fig, actions, palette, f"action (bands: pointwise {level} intervals)")
    return fig


def plot_tv_profiles(
    table: pl.DataFrame,
    actions: Sequence[str] | None = None,
    palette: Mapping[str, tuple] | None = None,
    where: str = "estimands",
) -> plt.Figure:
    """Figure 6: generation-clock E[δ_t] (left) and divergence-clock branch TV b_j =
    E[δ_{τ+j} | τ ≤ d] (right) per model (rows), pooled, with pointwise intervals; the
    generation-clock blocks are marked and the early and late lag windows shaded (SPEC §5)."""
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
    palette = _complete_palette(palette, actions)
    models = _models_in(table)
    paper_theme()
    fig, axes = plt.subplots(
        len(models), 2, figsize=(9.5, 2.7 * len(models) + 0.8), sharey=True, squeeze=False
    )
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    for i, model in enumerate(models):
        for k, (rows, xlabel, title) in enumerate(
            (
                (gen, "generation step $t$", r"generation clock $E[\delta_t]$"),
                (
                    branch,
                    r"lag $j$ after first divergence $\tau$",
                    rf"divergence clock $E[\delta_{{\tau+j}} \mid \tau \leq {depth}]$",
                ),
            )
        ):
            ax = axes[i][k]
            panel = rows.filter(
                (pl.col("model") == model)
                & (pl.col("stratum") == "pooled")
                & pl.col("action").is_in(actions)
            )
            if k == 1:
                for window, name in ((early, "early"), (late, "late")):
                    ax.axvspan(window.start - 0.5, window.stop - 0.5, color="0.92", zorder=0)
                    ax.text(
                        (window.start + window.stop - 1) / 2,
                        1.02,
                        name,
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        transform=ax.get_xaxis_transform(),
                    )
            else:
                for edge in edges[:-1]:
                    ax.axvline(edge + 0.5, color="0.6", lw=0.7, ls=":", zorder=0)
            context = f"{where}: profile of model {model!r}"
            _profile_facet(ax, panel, actions, palette, context, "figure 6")
            ax.set_xlim(0.5 if k == 1 else 1, int(rows["x"].max()) + (0.5 if k == 1 else 0))
            ax.set_xlabel(xlabel)
            ax.set_ylabel(r"rollout TV $\delta$" if k == 0 else "")
            ax.set_title(f"({next(letters)}) {model}: {title}", fontsize=9, loc="left", pad=12)
    level = _level_label(pl.concat([gen, branch])["ci_level"].to_list())
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    _legend(fig, actions, palette, f"action (bands: pointwise {level} intervals)")
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
    palette: Mapping,
) -> None:
    width = 0.7 / max(len(actions), 1)
    for j, action in enumerate(actions):
        offset = (j - (len(actions) - 1) / 2) * width
        r = rows.filter(pl.col("action") == action)
        order = {m: i for i, m in enumerate(models)}
        x = np.array([order[m] for m in r["model"].to_list()]) + offset
        v = r["value"].to_numpy()
        err = np.vstack([v - r["ci_low"].to_numpy(), r["ci_high"].to_numpy() - v])
        ax.errorbar(
            x, v, yerr=err, fmt="o", ms=5, lw=1.4, capsize=3, color=palette[action], label=action
        )
    ax.set_xticks(range(len(models)), list(models))
    ax.set_xlim(-0.6, len(models) - 0.4)


def plot_branch_endpoints(
    table: pl.DataFrame,
    actions: Sequence[str] | None = None,
    palette: Mapping[str, tuple] | None = None,
    where: str = "estimands",
) -> plt.Figure:
    """Figure 7: branch contrasts B(a) = late − early branch TV (a) and saturation S_.99 (b)
    per model and action, pooled, with the table's (family-adjusted) intervals (SPEC §5)."""
    require_estimands(table, ["branch_contrast_B", "S_99"], where, "figure 7")
    actions = list(actions) if actions is not None else _actions_in(table)
    palette = _complete_palette(palette, actions)
    models = _models_in(table)
    b_rows = _pooled_action_rows(table, "branch_contrast_B", actions, where, "figure 7")
    s_rows = _pooled_action_rows(table, "S_99", actions, where, "figure 7")
    paper_theme()
    fig, (ax_b, ax_s) = plt.subplots(1, 2, figsize=(9, 3.6))
    _dodged_intervals(ax_b, b_rows, models, actions, palette)
    ax_b.axhline(0, color="black", lw=0.8)
    ax_b.yaxis.set_major_formatter(_POINTS)
    ax_b.set_ylabel("B(a) = late − early branch TV, pp")
    ax_b.set_title(
        f"(a) branch contrast, {_level_label(b_rows['ci_level'].to_list())} intervals",
        fontsize=9,
        loc="left",
    )
    _dodged_intervals(ax_s, s_rows, models, actions, palette)
    ax_s.set_ylim(-0.02, 1.02)
    _percent_axis(ax_s)
    ax_s.set_ylabel(r"$S_{.99}$ = mean over $t$ of $P(\delta_t > .99)$")
    ax_s.set_title(
        f"(b) saturation, {_level_label(s_rows['ci_level'].to_list())} intervals",
        fontsize=9,
        loc="left",
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    _legend(fig, actions, palette, "action")
    return fig


def plot_decomposition(
    table: pl.DataFrame,
    contrasts: Sequence[str] | None = None,
    where: str = "estimands",
) -> plt.Figure:
    """Decomposition bars: ΔR_SMC = occurrence + exposure + rate terms per contrast and model,
    pooled (SPEC §2); stacked terms (positive up, negative down), ΔR_SMC with its interval as a
    black marker, and each term's share of ΔR_SMC printed on its segment."""
    terms = ("occurrence", "exposure", "rate")
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
    paper_theme()
    fig, axes = plt.subplots(
        1,
        len(models),
        figsize=(max(3.2, 1.3 * len(contrasts) + 1.2) * len(models), 4.0),
        sharey=True,
        squeeze=False,
    )
    for ax, model in zip(axes[0], models, strict=True):
        cell = rows.filter(pl.col("model") == model)
        values = {(r["contrast"], r["estimand"]): r for r in cell.iter_rows(named=True)}
        totals = cell.filter(pl.col("estimand") == "R_smc")
        span = float(np.nanmax(np.abs(totals.select("ci_low", "ci_high", "value").to_numpy())))
        for i, contrast in enumerate(contrasts):
            for name in need:
                if (contrast, name) not in values:
                    raise StudyTableError(
                        f"{where}: estimand {name!r} missing for model {model!r}, contrast "
                        f"{contrast!r} (needed by the decomposition figure)"
                    )
            up, down = 0.0, 0.0
            for term in terms:
                v = values[(contrast, f"gap_{term}")]["value"]
                share = values[(contrast, f"{term}_share")]["value"]
                base = up if v >= 0 else down
                ax.bar(
                    i,
                    v,
                    bottom=base,
                    width=0.6,
                    color=_TERM_COLORS[term],
                    edgecolor="white",
                    lw=0.5,
                    label=term if i == 0 else None,
                )
                if np.isfinite(share) and abs(v) >= 0.12 * span:
                    ax.text(
                        i,
                        base + v / 2,
                        f"{100 * share:.0f}%",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if term != "occurrence" else "black",
                    )
                if v >= 0:
                    up += v
                else:
                    down += v
            total = values[(contrast, "R_smc")]
            err = [[total["value"] - total["ci_low"]], [total["ci_high"] - total["value"]]]
            ax.errorbar(
                i + 0.38,
                total["value"],
                yerr=err,
                fmt="D",
                ms=4,
                color="black",
                capsize=2.5,
                lw=1,
                label=_DELTA_R if i == 0 else None,
            )
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(contrasts)), [c.replace(" - ", "\n− ") for c in contrasts])
        ax.tick_params(axis="x", labelsize=7)
        ax.yaxis.set_major_formatter(_POINTS)
        ax.set_title(model, fontsize=9)
    axes[0][0].set_ylabel(f"token-mismatch gap {_DELTA_R}, pp")
    level = _level_label(rows.filter(pl.col("estimand") == "R_smc")["ci_level"].to_list())
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.legend(
        handles,
        [f"{lab} term" if lab in terms else f"{lab} ({level} interval)" for lab in labels],
        loc="lower center",
        ncol=len(labels),
        frameon=False,
        fontsize=8,
        title=f"segments: terms of {_DELTA_R}, labelled with their share of it",
        title_fontsize=8,
    )
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
    control); ``palette_actions`` fixes the colours (default: ``actions``; ``control`` is drawn
    grey and takes no colour). Every figure is
    drawn before any file is written, so a missing estimand leaves no partial output.
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
    palette = action_palette(list(palette_actions or plotted), control)
    draw = {
        "fig5_divergence_cdf": lambda: plot_divergence_cdf(table, plotted, palette, where),
        "fig6_tv_profiles": lambda: plot_tv_profiles(table, plotted, palette, where),
        "fig7_branch_contrasts": lambda: plot_branch_endpoints(table, plotted, palette, where),
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
