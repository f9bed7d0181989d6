"""Figures of the finite-state study: the estimators (paper figure 4) and the identified
interval (paper figure 2), in the house style of :mod:`kvdiverge.plots.base` at the text
width.

Namesake: :mod:`kvdiverge.theory.finite_state` computes what these figures show.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import polars as pl  # noqa: E402

from kvdiverge.plots.base import (  # noqa: E402
    TEXT_WIDTH,
    figure_legend,
    new_figure,
    save_figure,
    series_styles,
)

__all__ = ["plot_estimators", "plot_identified_interval", "write_figures"]

_ESTIMATOR_STYLES = series_styles(["SWRB", "naive"])
_Z95 = 1.959963984540054


def _require(table: pl.DataFrame, columns: Sequence[str], name: str) -> None:
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise ValueError(f"{name}: missing column(s) {', '.join(missing)}")
    if table.height == 0:
        raise ValueError(f"{name}: expected at least one row")


def plot_estimators(systems: pl.DataFrame) -> plt.Figure:
    """Paper figure 4: naive and SWRB means against exact R_SMC, and the variance ratios.

    Left: each system's naive and SWRB sample means with 95% normal intervals
    (mean ± 1.96·sqrt(var/n_reps)) divided by the exact R_SMC, systems ordered by the exact
    divergence probability P(τ ≤ H) = H·O_H; the dashed line is exactness. Right: the
    naive-to-SWRB sample-variance ratio against P(τ ≤ H) (log–log) with the 1/P(τ ≤ H) guide.
    """
    need = ["system", "H", "n_reps", "exact_R", "exact_O", "naive_mean", "naive_var"]
    need += ["swrb_mean", "swrb_var", "var_ratio"]
    _require(systems, need, "systems table")
    table = systems.with_columns((pl.col("exact_O") * pl.col("H")).alias("p_div")).sort("p_div")
    order = {s: i for i, s in enumerate(table["system"].to_list())}
    long = pl.concat(
        [
            table.select(
                "system",
                "p_div",
                pl.lit(label).alias("estimator"),
                (pl.col(f"{prefix}_mean") / pl.col("exact_R")).alias("relative"),
                (
                    _Z95 * (pl.col(f"{prefix}_var") / pl.col("n_reps")).sqrt() / pl.col("exact_R")
                ).alias("half_width"),
            )
            for label, prefix in (("naive", "naive"), ("SWRB", "swrb"))
        ]
    )
    fig, axes = new_figure(TEXT_WIDTH, 2.9, 1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    ax_mean, ax_ratio = axes[0]
    offsets = {"naive": -0.17, "SWRB": 0.17}
    for label, group in long.group_by("estimator", maintain_order=True):
        label = label[0]
        style = _ESTIMATOR_STYLES[label]
        x = np.array([order[s] for s in group["system"].to_list()]) + offsets[label]
        ax_mean.errorbar(
            x,
            group["relative"].to_numpy(),
            yerr=group["half_width"].to_numpy(),
            fmt=style.marker,
            ms=3.5,
            lw=1,
            capsize=1.5,
            color=style.color,
            mec="white",
            mew=0.4,
            label=label,
        )
    ax_mean.axhline(1.0, color="black", ls="--", lw=0.8, label="exact")
    systems = table["system"].to_list()
    step = 1 if len(systems) <= 12 else 2  # two-digit labels at 8 pt: every other one
    ax_mean.set_xticks(
        range(table.height), [str(s) if i % step == 0 else "" for i, s in enumerate(systems)]
    )
    ax_mean.set_xlim(-0.7, table.height - 0.3)
    ax_mean.grid(axis="x", visible=False)
    ax_mean.set_xlabel(
        "system (ordered by exact P(τ ≤ H)" + ("; every other labelled)" if step > 1 else ")")
    )
    ax_mean.set_ylabel("sample mean / exact $R_{SMC}$")
    ax_mean.set_title("(a) estimates against the exact risk, 95% intervals")
    swrb = _ESTIMATOR_STYLES["SWRB"]
    ax_ratio.scatter(
        table["p_div"].to_numpy(),
        table["var_ratio"].to_numpy(),
        color=swrb.color,
        marker=swrb.marker,
        s=18,
        edgecolor="white",
        lw=0.4,
        zorder=2,
        label="system",
    )
    grid = np.geomspace(table["p_div"].min(), table["p_div"].max(), 50)
    ax_ratio.plot(grid, 1.0 / grid, color="black", ls=":", lw=0.9, label="1 / P(τ ≤ H)")
    ax_ratio.axhline(1.0, color="0.5", lw=0.6)
    ax_ratio.set(xscale="log", yscale="log")
    ax_ratio.set_xlabel("exact divergence probability P(τ ≤ H)")
    ax_ratio.set_ylabel("naive / SWRB sample variance")
    median = float(np.median(table["var_ratio"].to_numpy()))
    ax_ratio.set_title(f"(b) variance ratio (median {median:.1f})")
    handles, labels = [], []
    for ax in (ax_mean, ax_ratio):
        h, lab = ax.get_legend_handles_labels()
        handles += h
        labels += lab
    figure_legend(fig, handles, labels, ncol=len(labels))
    return fig


def plot_identified_interval(windows: pl.DataFrame, systems: Sequence[int]) -> plt.Figure:
    """Paper figure 2: the identified interval [R_L, R_L + B_L] against L with the realized R_H.

    One panel per system: the exact band between R_L and R_L + B_L, the realized R_H (dashed),
    and SWRB estimates of both endpoints with their Hoeffding intervals.
    """
    need = ["system", "L", "exact_R_L", "exact_B_L", "exact_R_H", "swrb_R_L", "swrb_R_L_lo"]
    need += ["swrb_R_L_hi", "swrb_upper", "swrb_upper_lo", "swrb_upper_hi", "alpha"]
    _require(windows, need, "windows table")
    known = set(windows["system"].to_list())
    absent = [s for s in systems if s not in known]
    if absent or not systems:
        raise ValueError(f"systems: expected systems present in the windows table, got {absent}")
    fig, axes = new_figure(TEXT_WIDTH, 2.6, 1, len(systems))
    band, lower, upper = series_styles(["band", "lower", "upper"]).values()
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    for ax, system in zip(axes[0], systems, strict=True):
        rows = windows.filter(pl.col("system") == system).sort("L")
        L = rows["L"].to_numpy()
        low = rows["exact_R_L"].to_numpy()
        high = low + rows["exact_B_L"].to_numpy()
        ax.fill_between(L, low, high, color=band.color, alpha=0.15, lw=0, label="identified")
        ax.plot(L, low, color=band.color, lw=1.0)
        ax.plot(L, high, color=band.color, lw=1.0)
        ax.axhline(rows["exact_R_H"][0], color="black", ls="--", lw=0.9, label="realized $R_H$")
        for col, lo, hi, style, name in (
            ("swrb_R_L", "swrb_R_L_lo", "swrb_R_L_hi", lower, "SWRB $R_L$"),
            ("swrb_upper", "swrb_upper_lo", "swrb_upper_hi", upper, "SWRB $R_L+B_L$"),
        ):
            est = rows[col].to_numpy()
            ax.errorbar(
                L * (0.94 if style is lower else 1.06),  # dodged on the log axis
                est,
                yerr=np.vstack([est - rows[lo].to_numpy(), rows[hi].to_numpy() - est]),
                fmt=style.marker,
                ms=3,
                lw=0.8,
                capsize=1.5,
                color=style.color,
                mec="white",
                mew=0.3,
                label=name,
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(L, [str(v) for v in L])
        ax.minorticks_off()
        top = float(max(high.max(), rows["swrb_upper"].max(), rows["swrb_R_L_hi"].max()))
        ax.set_ylim(bottom=0, top=1.1 * top)
        ax.set_xlabel("window depth L")
        ax.set_title(f"({next(letters)}) system {system}")
    axes[0][0].set_ylabel("$R_{SMC}$ (fraction of steps)")
    level = 1 - float(windows["alpha"][0])
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure_legend(
        fig,
        handles,
        labels,
        f"SWRB endpoint intervals: Hoeffding, {level:.0%} jointly",
        ncol=len(labels),
    )
    return fig


def write_figures(
    systems_csv: str | os.PathLike,
    windows_csv: str | os.PathLike,
    interval_systems: Sequence[int],
    estimators_out: tuple[str | os.PathLike, str | os.PathLike],
    interval_out: tuple[str | os.PathLike, str | os.PathLike],
) -> None:
    """Read the study tables and write both figures (PNG, PDF) atomically."""
    for path in (systems_csv, windows_csv):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path}: expected the finite-state study table")
    save_figure(plot_estimators(pl.read_csv(systems_csv)), *estimators_out)
    save_figure(plot_identified_interval(pl.read_csv(windows_csv), interval_systems), *interval_out)
