"""Figures of ``kvdiverge compare`` stay legible with eight actions and 40-character labels: every
legend, tick label and title lies inside the canvas once drawn (matplotlib's renderer), legends
do not cover the panels, and no text is smaller than the house minimum."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
import pytest  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from kvdiverge.analysis.document_stats import document_stats  # noqa: E402
from kvdiverge.analysis.estimands import estimands_table  # noqa: E402
from kvdiverge.analysis.synthetic import stratum_pairs, write_synthetic_study  # noqa: E402
from kvdiverge.compare.contrasts import baseline_contrasts, plot_contrasts  # noqa: E402
from kvdiverge.plots.accuracy import plot_accuracy  # noqa: E402
from kvdiverge.plots.base import MIN_FONT_PT, smallest_font  # noqa: E402
from kvdiverge.plots.study import plot_decomposition, plot_divergence_cdf  # noqa: E402

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


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    assert len(LABELS) == 8 and all(len(a) == 40 for a in LABELS)
    root = tmp_path_factory.mktemp("legends")
    lambdas = {a: 0.1 + 0.1 * i for i, a in enumerate(LABELS)}
    files = write_synthetic_study(
        root, "study1", "tiny", {"custom-prompts": stratum_pairs(3, lambdas)}, {"study1": (6, 2)},
        H=8, seed=1,
    )  # fmt: skip
    trajectories = {a: list(files[a].values()) for a in LABELS}
    stats, clock = document_stats(trajectories, list(files["documents"].values()))
    base = LABELS[0]
    contrasts = [(a, base) for a in LABELS[1:]]
    table = estimands_table(
        stats, clock, model="tiny", actions=LABELS, contrasts=contrasts, draws=50, seed=0
    )
    return table, stats


def _inside(fig) -> list[str]:
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


def _accuracy_table(actions):
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


def test_divergence_cdf_legend_inside_the_canvas(study):
    table, _ = study
    fig = plot_divergence_cdf(table, LABELS)
    try:
        assert _inside(fig) == []
        assert smallest_font(fig) >= MIN_FONT_PT
        # every label shown in full (wrapped lines joined back)
        shown = [t.get_text().replace("\n", "") for t in fig.legends[0].get_texts()]
        assert shown == LABELS
    finally:
        plt.close(fig)


def test_accuracy_figure_inside_the_canvas(study):
    fig = plot_accuracy(_accuracy_table(LABELS), LABELS)
    try:
        assert _inside(fig) == []
        assert smallest_font(fig) >= MIN_FONT_PT
    finally:
        plt.close(fig)


def test_decomposition_and_contrast_figures_inside_the_canvas(study):
    table, stats = study
    contrasts = [f"{a} - {LABELS[0]}" for a in LABELS[1:]]
    fig = plot_decomposition(table, contrasts)
    try:
        assert _inside(fig) == []
    finally:
        plt.close(fig)
    acc = stats.select("doc_id", "action", "stratum").with_columns(
        acc_y=pl.Series(np.linspace(0, 1, stats.height))
    )
    contrast_table, _ = baseline_contrasts(
        table, stats, acc, LABELS, LABELS[0], H=8, metric="substring_match",
        draws=50, seed=0, level=0.95, temperature=1.0,
    )  # fmt: skip
    fig = plot_contrasts(contrast_table)
    try:
        assert _inside(fig) == []
        assert smallest_font(fig) >= MIN_FONT_PT
        ticks = [t.get_text().replace("\n", "") for t in fig.axes[0].get_yticklabels()]
        assert ticks == LABELS[1:]
    finally:
        plt.close(fig)


def test_a_short_legend_keeps_the_figure_size(study):
    table, _ = study
    fig = plot_divergence_cdf(table, LABELS[:2])
    try:
        assert fig.get_figheight() == pytest.approx(0.8 + 1.6)
        assert _inside(fig) == []
    finally:
        plt.close(fig)


def test_an_all_zero_accuracy_panel_says_so_instead_of_plotting_zeros(study):
    table, stats = study
    acc = stats.select("doc_id", "action", "stratum").with_columns(acc_y=pl.lit(0.0))
    contrast_table, summary = baseline_contrasts(
        table, stats, acc, LABELS[:3], LABELS[0], H=8, metric="substring_match",
        draws=50, seed=0, level=0.95, temperature=0.0,
    )  # fmt: skip
    fig = plot_contrasts(contrast_table)
    try:
        panel = fig.axes[3]
        assert [t.get_text() for t in panel.texts] == [
            "no generation answers\ncorrectly (accuracy 0%\nfor every action):\nnothing to compare"
        ]
        assert len(panel.lines) == 0 and list(panel.get_xticks()) == []
        assert len(fig.axes[0].lines) > 0  # the other panels are drawn
        assert _inside(fig) == []
    finally:
        plt.close(fig)
    assert "so task accuracy does not tell them apart here" in summary
    assert "greedy decoding" in summary
