"""The figure of ``kvdiverge merge`` (:mod:`kvdiverge.compare.merge`): several runs side by side.

Three panels — P(τ ≤ H), the mean entry time E[τ | τ ≤ H] and R_SMC — with one row per
(model, action) and one colour and marker per run: each run's pooled value and its interval,
dodged vertically so that runs of the same action do not overlap. Drawn from the merged table's
estimand rows only (nothing is re-estimated).
"""

from __future__ import annotations

import math
import textwrap

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import polars as pl  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from kvdiverge.plots.base import TEXT_WIDTH, figure_legend, new_figure, series_styles  # noqa: E402

__all__ = ["MERGE_PANELS", "plot_merged"]

MERGE_PANELS = (
    ("div_prob", r"$P(\tau \leq H)$, %", 100.0),
    ("mean_entry_time", r"$E[\tau \mid \tau \leq H]$, steps", 1.0),
    ("R_smc", r"$R_{\mathrm{SMC}}$, %", 100.0),
)


def plot_merged(merged: pl.DataFrame) -> plt.Figure:
    """The merged runs' divergence measures (module docstring); ``merged``:
    :func:`kvdiverge.compare.merge.merge_runs`'s table."""
    own = merged.filter(
        (pl.col("table") == "estimands")
        & (pl.col("contrast") == "")
        & pl.col("estimand").is_in([e for e, _, _ in MERGE_PANELS])
    )
    runs = own["run"].unique(maintain_order=True).to_list()
    rows = own.select("model", "action").unique(maintain_order=True).rows()
    styles = series_styles(runs)
    height = 1.3 + 0.28 * len(rows) * max(1.0, len(runs) / 3)
    fig, axes = new_figure(TEXT_WIDTH, height, 1, len(MERGE_PANELS), sharey=True)
    step = 0.6 / max(len(runs), 1)
    for ax, (estimand, label, scale) in zip(axes[0], MERGE_PANELS, strict=True):
        panel = own.filter(pl.col("estimand") == estimand)
        for k, run in enumerate(runs):
            style = styles[run]
            offset = (k - (len(runs) - 1) / 2) * step
            for i, (model, action) in enumerate(rows):
                found = panel.filter(
                    (pl.col("run") == run)
                    & (pl.col("model") == model)
                    & (pl.col("action") == action)
                )
                if found.height == 0:
                    continue
                r = found.row(0, named=True)
                if r["value"] is None or not math.isfinite(r["value"]):
                    ax.text(0.02, i + offset, "undefined", va="center", fontsize=7, color="0.4",
                            transform=ax.get_yaxis_transform())  # fmt: skip
                    continue
                v = scale * r["value"]
                lo, hi = r["ci_low"], r["ci_high"]
                err = None
                if lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi):
                    err = [[v - scale * lo], [scale * hi - v]]
                drawn = ax.errorbar([v], [i + offset], xerr=err, fmt=style.marker,
                                    color=style.color, ms=4.5, capsize=2)  # fmt: skip
                drawn.lines[0].set_gid(f"run:{run}:{model}:{action}")
        ax.set_xlabel(label)
        ax.grid(axis="y", visible=False)
        ax.margins(x=0.12)
    names = [textwrap.fill(f"{a} ({m})" if len({m for m, _ in rows}) > 1 else a, 26)
             for m, a in rows]  # fmt: skip
    axes[0][0].set_yticks(range(len(rows)), names)
    axes[0][0].set_ylim(len(rows) - 0.5, -0.5)
    handles = [Line2D([], [], marker=styles[r].marker, color=styles[r].color, ls="") for r in runs]
    level = next((float(v) for v in own["ci_level"].to_list() if v is not None), 0.95)
    figure_legend(fig, handles, runs, f"run (bars: each run's {100 * level:g}% interval)")
    return fig
