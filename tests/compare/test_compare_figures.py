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
from figure_helpers import LABELS, accuracy_table, texts_outside  # noqa: E402

from kvdiverge.analysis.document_stats import document_stats  # noqa: E402
from kvdiverge.analysis.estimands import estimands_table  # noqa: E402
from kvdiverge.analysis.synthetic import stratum_pairs, write_synthetic_study  # noqa: E402
from kvdiverge.compare.contrasts import baseline_contrasts, plot_contrasts  # noqa: E402
from kvdiverge.plots.accuracy import plot_accuracy  # noqa: E402
from kvdiverge.plots.base import MIN_FONT_PT, smallest_font  # noqa: E402
from kvdiverge.plots.study import plot_decomposition, plot_divergence_cdf  # noqa: E402


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


def test_divergence_cdf_legend_inside_the_canvas(study):
    table, _ = study
    fig = plot_divergence_cdf(table, LABELS)
    try:
        assert texts_outside(fig) == []
        assert smallest_font(fig) >= MIN_FONT_PT
        # every label shown in full (wrapped lines joined back)
        shown = [t.get_text().replace("\n", "") for t in fig.legends[0].get_texts()]
        assert shown == LABELS
    finally:
        plt.close(fig)


def test_accuracy_figure_inside_the_canvas(study):
    fig = plot_accuracy(accuracy_table(LABELS), LABELS)
    try:
        assert texts_outside(fig) == []
        assert smallest_font(fig) >= MIN_FONT_PT
    finally:
        plt.close(fig)


def test_decomposition_and_contrast_figures_inside_the_canvas(study):
    table, stats = study
    contrasts = [f"{a} - {LABELS[0]}" for a in LABELS[1:]]
    fig = plot_decomposition(table, contrasts)
    try:
        assert texts_outside(fig) == []
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
        assert texts_outside(fig) == []
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
        assert texts_outside(fig) == []
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
        assert texts_outside(fig) == []
    finally:
        plt.close(fig)
    assert "so task accuracy does not tell them apart here" in summary
    assert "greedy decoding" in summary
