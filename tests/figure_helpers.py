"""Legibility checks shared by the figure tests of ``kvdiverge compare`` and of the pipeline:
eight actions with 40-character labels, the texts of a drawn figure that leave its canvas, and
an accuracy table for those actions."""

from __future__ import annotations

import polars as pl
from matplotlib.text import Text

MIN_PANEL = 1.0
"""Inches: the smallest side of a legible panel."""


LABELS = [
    f"{name:<{40 - 4}}@0.5".replace(" ", "_")[:40]
    for name in (
        "snapkv_with_a_long_window_baseline",
        "my_methods:SinkStride+sinks=4+tag=x",
        "recent_sinks_and_a_very_long_name",
        "kvpress+press=KnormPress+extra=1",
        "kvpress+press=TOVAPress+extra=22",
        "pyramid_budget_per_layer_variant",
        "adakv_around_snapkv_per_head_budget",
        "expected_attention_press_defaults",
    )
]


def texts_outside(fig) -> list[str]:
    """Texts of ``fig`` (legends included) whose drawn extent leaves the canvas."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    canvas = fig.bbox
    bad = []
    for legend in fig.legends:
        box = legend.get_window_extent(renderer)
        if box.x0 < canvas.x0 - 1 or box.x1 > canvas.x1 + 1 or box.y1 > canvas.y1 + 1:
            bad.append(f"legend {box} outside {canvas}")
        for ax in fig.axes:
            # the panel with its tick labels, axis labels and title
            if ax.get_visible() and box.overlaps(ax.get_tightbbox(renderer)):
                bad.append(f"legend {box} covers the panel {ax.get_tightbbox(renderer)}")
    for ax in fig.axes:
        size = ax.get_window_extent(renderer)
        if ax.get_visible() and min(size.width, size.height) < MIN_PANEL * fig.dpi:
            bad.append(f"panel {ax.get_title()!r} squashed to {size.width}x{size.height} px")
    ticks, drawn = set(), []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks():
                ticks |= {id(tick.label1), id(tick.label2)}
                if lo - 1e-9 <= tick.get_loc() <= hi + 1e-9:  # drawn ticks only
                    drawn += [tick.label1, tick.label2]
    texts = [t for t in fig.findobj(Text) if id(t) not in ticks] + drawn
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            shown = [
                t.label1.get_window_extent(renderer)
                for t in axis.get_major_ticks()
                if lo - 1e-9 <= t.get_loc() <= hi + 1e-9 and t.label1.get_text().strip()
            ]
            for a, b in zip(shown, shown[1:], strict=False):
                if a.overlaps(b):
                    bad.append(f"tick labels overlap at {a} and {b}")
    for text in texts:
        if not text.get_visible() or not text.get_text().strip():
            continue
        box = text.get_window_extent(renderer)
        if box.x0 < canvas.x0 - 1 or box.x1 > canvas.x1 + 1 or box.y0 < canvas.y0 - 1:
            bad.append(f"text {text.get_text()!r} at {box} outside {canvas}")
        if box.y1 > canvas.y1 + 1:
            bad.append(f"text {text.get_text()!r} at {box} outside {canvas}")
    return bad


def accuracy_table(actions):
    rows = []
    names = ["accuracy_drop", "accuracy_x", "accuracy_y"]
    for c in ("early", "late", "never"):
        names += [f"share@{c}", f"accuracy_x@{c}", f"accuracy_y@{c}", f"accuracy_drop@{c}"]
    for i, a in enumerate(actions):
        for e in names:
            v = 0.1 + 0.01 * i
            rows.append(
                {"model": "tiny", "action": a, "contrast": "", "stratum": "pooled",
                 "estimand": e, "value": v, "ci_low": v - 0.05, "ci_high": v + 0.05,
                 "ci_level": 0.95, "n_docs": 6, "n_paths": 12, "draws_dropped": 0}
            )  # fmt: skip
    return pl.DataFrame(rows)
