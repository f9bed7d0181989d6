"""``kvdiverge compare --baseline``: every action minus the baseline, with paired bootstrap
intervals, as a table, a figure and plain sentences.

The table and the sentences are :mod:`kvdiverge.tables.contrasts`'s (the pipeline's rule
study_contrasts writes the same for a study's ``baseline``); this module draws the contrast
figure and writes the compare folder's files.

Namesakes by layer: :mod:`kvdiverge.plots.contrasts` draws a study's figures 6 and 7 (branch
endpoints, gap decompositions), not these contrasts.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import polars as pl

from kvdiverge.tables.accuracy import all_zero_or_undefined
from kvdiverge.tables.contrasts import (
    CONTRAST_ESTIMANDS,
    accuracy_contrasts,
    baseline_contrasts,
    contrast_pairs_of,
    contrast_sentences,
    render_contrasts,
)

__all__ = [
    "CONTRAST_ESTIMANDS",
    "accuracy_contrasts",
    "baseline_contrasts",
    "contrast_sentences",
    "plot_contrasts",
    "render_contrasts",
    "write_contrast_outputs",
]

_PANELS = (
    ("R_smc", r"$\Delta R_{\mathrm{SMC}}$, pp", 100.0),
    ("div_prob", r"$\Delta P(\tau \leq H)$, pp", 100.0),
    ("mean_entry_time", r"$\Delta E[\tau \mid \tau \leq H]$, steps", 1.0),
    ("accuracy", r"$\Delta$ task accuracy, pp", 100.0),
)


def _empty_panel_note(rows: pl.DataFrame, estimand: str) -> str | None:
    """Why a panel of the contrast figure has nothing to show, or None: every difference
    undefined, or (accuracy) every action and the baseline at 0."""
    finite = [v for v in rows["value"].to_list() if v is not None and math.isfinite(v)]
    if not finite:
        return "undefined for every action\n(no divergence to time)"
    sides = [*rows["action_value"].to_list(), *rows["baseline_value"].to_list()]
    if estimand == "accuracy" and all_zero_or_undefined(sides):
        return (
            "no generation answers\ncorrectly (accuracy 0%\nfor every action):\nnothing to compare"
        )
    return None


def plot_contrasts(table: pl.DataFrame, styles: dict | None = None):
    """The contrast figure: one panel per headline difference (ΔR_SMC, Δ P(τ ≤ H), Δ mean
    entry time, Δ accuracy), one row per action, point and paired interval, zero marked; the
    actions' names are the rows' labels (left of the first panel), the baseline in the title."""
    from kvdiverge.plots.base import TEXT_WIDTH, empty_panel, new_figure, series_styles

    actions = table["action"].unique(maintain_order=True).to_list()
    baselines = table["baseline"].unique(maintain_order=True).to_list()
    baseline = baselines[0]
    styles = styles or series_styles([*baselines, *actions])
    lines = sum(1 + len(a) // 25 for a in actions)
    height = 1.4 + 0.2 * lines + 0.1 * len(actions)
    fig, axes = new_figure(TEXT_WIDTH, height, 1, len(_PANELS), sharey=True)
    for ax, (estimand, label, scale) in zip(axes[0], _PANELS, strict=True):
        rows = table.filter(pl.col("estimand") == estimand)
        values = {r["action"]: r for r in rows.iter_rows(named=True)}
        note = _empty_panel_note(rows, estimand)
        if note is not None:  # nothing to draw: say so instead of plotting zeros
            empty_panel(ax, note, label)
            continue
        for i, action in enumerate(actions):
            r = values.get(action)
            if r is None or r["value"] is None or not math.isfinite(r["value"]):
                ax.text(0, i, "undefined", ha="center", va="center", color="0.4")
                continue
            v, lo, hi = (scale * r[k] for k in ("value", "ci_low", "ci_high"))
            err = [[v - lo], [hi - v]] if math.isfinite(lo) and math.isfinite(hi) else None
            style = styles[action]
            ax.errorbar([v], [i], xerr=err, fmt=style.marker, color=style.color, ms=5, capsize=2.5)
        ax.axvline(0, color="black", lw=0.8, zorder=1)
        ax.set_xlabel(label)
        ax.grid(axis="y", visible=False)
        ax.margins(x=0.15)
    wrapped = [textwrap.fill(a, 24, break_on_hyphens=False) for a in actions]
    axes[0][0].set_yticks(range(len(actions)), wrapped)
    axes[0][0].set_ylim(len(actions) - 0.5, -0.5)
    level = float(table["ci_level"][0])
    if len(baselines) > 1:  # a paired budget grid
        what = f"each action minus the baseline at its own budget ({', '.join(baselines)})"
    else:
        what = f"each action minus the baseline {baseline}"
    title = textwrap.fill(what, 90)
    fig.suptitle(f"{title}\n(paired {100 * level:g}% document-bootstrap intervals)")
    return fig


def write_contrast_outputs(
    table: pl.DataFrame,
    summary: str,
    estimands: pl.DataFrame,
    actions: Sequence[str],
    baseline: str | Mapping[str, str],
    root: Path,
) -> None:
    """``contrasts.{csv,md}``, ``summary.md``, ``contrasts.{png,pdf}`` and the decomposition
    bars ``decomposition.{png,pdf}`` (:func:`kvdiverge.plots.study.plot_decomposition`)."""
    from kvdiverge.io import atomic_path, atomic_write_text
    from kvdiverge.plots.base import save_figure, series_styles
    from kvdiverge.plots.study import plot_decomposition

    with atomic_path(root / "contrasts.csv", suffix=".csv") as tmp:
        table.write_csv(tmp)
    atomic_write_text(root / "contrasts.md", render_contrasts(table))
    atomic_write_text(root / "summary.md", summary)
    styles = series_styles(list(actions))
    save_figure(plot_contrasts(table, styles), root / "contrasts.png", root / "contrasts.pdf")
    contrasts = [f"{a} - {b}" for a, b in contrast_pairs_of(actions, baseline)]
    save_figure(
        plot_decomposition(estimands, contrasts, "estimands"),
        root / "decomposition.png",
        root / "decomposition.pdf",
    )
