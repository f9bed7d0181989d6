"""The house style of every figure (kvdiverge.plots.base): print size and legibility, percent
ticks that are never rounded, axes fitted to the data, distinguishable series, and the
figure-specific rules (figure 5 pooled and per stratum, shares left out of the decomposition
where ΔR_SMC's interval covers 0)."""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import polars as pl
import pytest
from study_helpers import CONTROL, LAMBDAS, STRATA, STUDY2_LAMBDAS, build_study

from kvdiverge.plots.base import (
    COLUMN_WIDTH,
    DPI,
    MIN_FONT_PT,
    TEXT_WIDTH,
    PercentTicks,
    house_style,
    save_figure,
    smallest_font,
    tick_decimals,
)
from kvdiverge.plots.finite_state import plot_estimators, plot_identified_interval
from kvdiverge.plots.study import (
    plot_branch_endpoints,
    plot_decomposition,
    plot_divergence_cdf,
    plot_divergence_cdf_strata,
    plot_tv_profiles,
    write_study_figures,
)
from kvdiverge.plots.theory import plot_introductory_example
from kvdiverge.tables import read_estimands
from kvdiverge.theory.finite_state_study import study_tables

COMPARED = [a for a in LAMBDAS if a != CONTROL]
STUDY2 = [a for a in STUDY2_LAMBDAS if a != CONTROL]


@pytest.fixture(scope="module")
def study1(tmp_path_factory):
    est, _ = build_study(tmp_path_factory.mktemp("style1"), pair=None)
    return est, read_estimands(est)


@pytest.fixture(scope="module")
def study2(tmp_path_factory):
    est, _ = build_study(
        tmp_path_factory.mktemp("style2"), STUDY2_LAMBDAS, family_size=8, pair=None
    )
    return read_estimands(est)


@pytest.fixture(scope="module")
def finite_state_tables():
    section = {
        "n_systems": 4,
        "horizon": 8,
        "n_states": 3,
        "n_tokens": 4,
        "eos_prob": 0.1,
        "dirichlet_alpha": 1.0,
        "alt_strength": 0.4,
        "n_reps": 300,
        "window_depths": [1, 3, 8],
        "interval_figure_systems": [0, 3],
        "alpha": 0.05,
    }
    return study_tables({"seed": 11, "finite_state": section})


def _all_figures(study1, study2, finite_state_tables):
    _, t1 = study1
    systems, windows = finite_state_tables
    return {
        "fig1": lambda: plot_introductory_example(0.2, 32),
        "estimators": lambda: plot_estimators(systems),
        "interval": lambda: plot_identified_interval(windows, [0, 3]),
        "fig5": lambda: plot_divergence_cdf(t1, COMPARED),
        "fig5_strata": lambda: plot_divergence_cdf_strata(t1, COMPARED),
        "fig6": lambda: plot_tv_profiles(t1, COMPARED),
        "fig7": lambda: plot_branch_endpoints(study2, STUDY2),
        "decomposition": lambda: plot_decomposition(t1),
    }


def _number(label: str) -> float:
    return float(label.replace("\N{MINUS SIGN}", "-").rstrip("%"))


def test_percent_ticks_are_never_rounded():
    ticks = [-0.125, -0.1, -0.075, -0.05, -0.025, 0.0, 0.025]
    labels = PercentTicks().format_ticks(ticks)
    assert labels == ["−12.5%", "−10.0%", "−7.5%", "−5.0%", "−2.5%", "0.0%", "2.5%"]
    assert PercentTicks("").format_ticks([0.0, 0.2, 0.4]) == ["0", "20", "40"]
    assert PercentTicks().format_ticks([-0.0, 0.5]) == ["0%", "50%"]  # no "−0"
    assert tick_decimals([0.001, 0.0015]) == 2
    assert tick_decimals([1 / 3], most=3) == 3


def test_every_figure_is_legible_at_its_print_size(study1, study2, finite_state_tables):
    for name, draw in _all_figures(study1, study2, finite_state_tables).items():
        fig = draw()
        try:
            width, _ = fig.get_size_inches()
            assert smallest_font(fig) >= MIN_FONT_PT, name
            assert width <= TEXT_WIDTH + 1e-9, (name, width)
            if name == "fig5":
                assert width == pytest.approx(COLUMN_WIDTH)  # a column-wide main figure
        finally:
            plt.close(fig)


def test_every_percent_axis_labels_its_ticks_exactly(study1, study2, finite_state_tables):
    checked = 0
    for name, draw in _all_figures(study1, study2, finite_state_tables).items():
        fig = draw()
        try:
            fig.canvas.draw()
            for ax in fig.axes:
                if not isinstance(ax.yaxis.get_major_formatter(), PercentTicks):
                    continue
                low, high = sorted(ax.get_ylim())
                for tick in ax.yaxis.get_major_ticks():
                    loc, text = tick.get_loc(), tick.label1.get_text()
                    if low <= loc <= high and text:
                        assert _number(text) == pytest.approx(100 * loc, abs=1e-9), (name, text)
                        assert text not in ("−0", "−0%"), text
                        checked += 1
        finally:
            plt.close(fig)
    assert checked > 30


def test_figure7_axes_fit_the_data(study2):
    rows = study2.filter((pl.col("stratum") == "pooled") & pl.col("action").is_in(STUDY2))
    fig = plot_branch_endpoints(study2, STUDY2)
    try:
        ax_b, ax_s = fig.axes[:2]
        s99 = rows.filter(pl.col("estimand") == "S_99")
        top = float(s99.select("ci_high", "value").max().max_horizontal()[0])
        low, high = ax_s.get_ylim()
        assert low <= 0 and high <= max(1.1 * top, top + 0.06) < 1.0  # not a fixed 0–100%
        b = rows.filter(pl.col("estimand") == "branch_contrast_B")
        lo, hi = float(b["ci_low"].min()), float(b["ci_high"].max())
        b_low, b_high = ax_b.get_ylim()
        assert b_low <= min(lo, 0) and b_high >= max(hi, 0)
        assert b_high - b_low <= 1.3 * (max(hi, 0) - min(lo, 0))
    finally:
        plt.close(fig)


def test_series_differ_in_line_style_and_bands_are_outlined(study1):
    _, table = study1
    fig = plot_divergence_cdf(table, COMPARED)
    try:
        ax = fig.axes[0]
        thick = [ln for ln in ax.get_lines() if ln.get_linewidth() >= 1.4]
        assert len(thick) == len(COMPARED)
        assert len({str(ln.get_linestyle()) for ln in thick}) == len(COMPARED)
        assert len({ln.get_color() for ln in thick}) == len(COMPARED)
        edges = [ln for ln in ax.get_lines() if ln.get_linewidth() < 1.0]
        assert len(edges) == 2 * len(COMPARED)  # each band's two edges are drawn
    finally:
        plt.close(fig)


def test_figure5_appendix_has_one_panel_per_model_and_stratum(study1):
    _, table = study1
    fig = plot_divergence_cdf_strata(table, COMPARED)
    try:
        shown = [ax for ax in fig.axes if ax.get_visible()]
        assert len(shown) == 2 * len(STRATA)
        titles = {ax.get_title(loc="left") for ax in shown}
        assert any("RULER–2048" in t for t in titles) and any("HELMET–1024" in t for t in titles)
    finally:
        plt.close(fig)
    pooled = plot_divergence_cdf(table, COMPARED)
    try:
        assert len(pooled.axes) == 2  # one panel per model: the pooled curves only
    finally:
        plt.close(pooled)


def _share_labels(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts if t.get_text().endswith("%")]


def test_decomposition_leaves_out_shares_where_the_gap_covers_zero(study1):
    _, table = study1
    fig = plot_decomposition(table)
    try:
        assert _share_labels(fig)
    finally:
        plt.close(fig)
    covering = table.with_columns(
        ci_low=pl.when((pl.col("contrast") != "") & (pl.col("estimand") == "R_smc"))
        .then(-0.5)
        .otherwise(pl.col("ci_low")),
        ci_high=pl.when((pl.col("contrast") != "") & (pl.col("estimand") == "R_smc"))
        .then(0.5)
        .otherwise(pl.col("ci_high")),
    )
    fig = plot_decomposition(covering)
    try:
        assert _share_labels(fig) == []
        assert "not shown where its interval covers 0" in fig.legends[0].get_title().get_text()
    finally:
        plt.close(fig)


def _png_size(path: Path) -> tuple[int, int]:
    return struct.unpack(">II", path.read_bytes()[16:24])


def test_files_are_written_at_print_size(study1, tmp_path):
    est, _ = study1
    outputs = {
        name: (tmp_path / f"{name}.png", tmp_path / f"{name}.pdf")
        for name in ("fig5_divergence_cdf", "fig5_divergence_cdf_strata")
    }
    write_study_figures(est, outputs, COMPARED, None, CONTROL)
    width, _ = _png_size(outputs["fig5_divergence_cdf"][0])
    assert width == round(COLUMN_WIDTH * DPI)
    width, _ = _png_size(outputs["fig5_divergence_cdf_strata"][0])
    assert width == round(TEXT_WIDTH * DPI)
    assert np.all([p.read_bytes()[:5] == b"%PDF-" for _, p in outputs.values()])


def test_saving_a_pdf_logs_no_font_subsetting(tmp_path, caplog):
    """The PDF backend's font subsetting (fontTools) adds no INFO lines to a figure job's log
    (issue 17: no noise lines)."""
    caplog.set_level(logging.INFO)
    house_style()  # TrueType fonts in the PDF: subsetted by fontTools
    fig, ax = plt.subplots(figsize=(COLUMN_WIDTH, 2.0))
    ax.plot([0, 1], [0, 1], label="a line")
    ax.set_title("Subsetted glyphs: 0123456789 %")
    ax.legend()
    save_figure(fig, tmp_path / "f.png", tmp_path / "f.pdf")
    assert (tmp_path / "f.pdf").stat().st_size > 0
    noise = [r for r in caplog.records if r.name.startswith("fontTools")]
    assert noise == [], [r.getMessage() for r in noise[:3]]
