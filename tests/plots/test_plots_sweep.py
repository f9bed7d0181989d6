"""The pipeline's study figures and tables under actions' labels, and a study's budget-sweep
figure (issue 31, items 1 and 5): legends show the labels in full and lie inside the canvas
with eight actions and 40-character labels; the sweep figure draws exactly the estimands
table's pooled rows, one line per method and one row of panels per model."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import polars as pl
import pytest
from figure_helpers import LABELS, accuracy_table, texts_outside
from study_helpers import CONTROL, LAMBDAS, build_study

from kvdiverge.plots.accuracy import plot_accuracy
from kvdiverge.plots.base import MIN_FONT_PT, smallest_font
from kvdiverge.plots.study import (
    FIGURES,
    plot_decomposition,
    plot_divergence_cdf,
    write_study_figures,
)
from kvdiverge.plots.sweep import (
    SWEEP_ESTIMANDS,
    dodge,
    plot_sweep,
    sweep_table,
    write_sweep_figure,
)
from kvdiverge.tables import StudyTableError, read_estimands, write_study_tables
from kvdiverge.tables.accuracy import accuracy_study_table

NAMES = [f"a{i}" for i in range(1, 9)]
SWEPT = {
    "full": 0.0,
    "sweep@0.25": 0.6,
    "sweep@0.5": 0.35,
    "sweep@0.75": 0.15,
    "r25": 0.7,
    "r75": 0.3,
    "other": 0.45,
}
SWEEP = {
    "sweep@0.25": ("SnapKV", 0.25),
    "sweep@0.5": ("SnapKV", 0.5),
    "sweep@0.75": ("SnapKV", 0.75),
    "r25": ("recent+sinks=2", 0.25),
    "r75": ("recent+sinks=2", 0.75),
}


HIDDEN = "Bbox(x0=0.0, y0=0.0, x1=1.0, y1=1.0)"
"""The drawn extent of a tick label a shared axis hides (the upper panel's x ticks)."""


def _outside(fig) -> list[str]:
    """``figure_helpers.texts_outside`` without the hidden tick labels of shared axes."""
    return [problem for problem in texts_outside(fig) if HIDDEN not in problem]


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    """A two-model study of eight compared actions and the control."""
    lambdas = {CONTROL: 0.0} | {a: 0.1 + 0.08 * i for i, a in enumerate(NAMES)}
    est, _ = build_study(tmp_path_factory.mktemp("eight"), lambdas, pair=None, draws=30)
    return est


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    est, _ = build_study(tmp_path_factory.mktemp("swept"), SWEPT, pair=None, draws=30)
    return est


def test_the_pipeline_divergence_cdf_shows_40_character_labels_inside_the_canvas(eight, tmp_path):
    labels = dict(zip(NAMES, LABELS, strict=True))
    fig = plot_divergence_cdf(read_estimands(eight), NAMES, labels=labels)
    try:
        assert len({ax.get_title(loc="left") for ax in fig.axes}) == 2  # one panel per model
        assert _outside(fig) == []
        assert smallest_font(fig) >= MIN_FONT_PT
        shown = [t.get_text().replace("\n", "") for t in fig.legends[0].get_texts()]
        assert shown == LABELS
    finally:
        plt.close(fig)
    # the rule's writer passes them on: every figure of the study drawn under labels
    outputs = {n: (tmp_path / f"{n}.png", tmp_path / f"{n}.pdf") for n in FIGURES}
    write_study_figures(eight, outputs, NAMES, control=CONTROL, labels=labels)
    assert all(png.stat().st_size > 20_000 for png, _ in outputs.values())


def test_the_decomposition_of_every_pair_of_eight_labelled_actions_is_legible(eight):
    """Eight actions give 28 contrasts per model: horizontal bars, one row per contrast, every
    label shown in full inside the canvas."""
    labels = dict(zip(NAMES, LABELS, strict=True))
    table = read_estimands(eight)
    contrasts = table.filter(pl.col("contrast") != "")["contrast"].unique(maintain_order=True)
    assert len(contrasts) == 28
    fig = plot_decomposition(table, None, labels=labels)
    try:
        assert _outside(fig) == []
        assert smallest_font(fig) >= MIN_FONT_PT
        ticks = [t.get_text().replace("\n", "") for t in fig.axes[0].get_yticklabels()]
        expected = [" - ".join(labels[a] for a in c.split(" - ")) for c in contrasts]
        assert [t.replace("− ", " - ") for t in ticks] == expected
    finally:
        plt.close(fig)


def test_the_accuracy_figure_and_table_show_labels():
    labels = dict(zip(NAMES, LABELS, strict=True))
    table = accuracy_table(NAMES)
    fig = plot_accuracy(table, NAMES, labels=labels)
    try:
        assert _outside(fig) == []
        ticks = [t.get_text().replace("\n", "") for t in fig.axes[0].get_yticklabels()]
        assert ticks == LABELS
        legend = [t.get_text().replace("\n", "") for t in fig.legends[0].get_texts()]
        assert legend[: len(LABELS)] == LABELS
    finally:
        plt.close(fig)
    built = accuracy_study_table(table, NAMES, labels=labels)
    assert [r[1] for r in built.rows] == LABELS
    assert built.data["action"].to_list() == NAMES


def test_tables_show_labels_and_their_csv_keeps_the_names(tmp_path):
    est, pred = build_study(tmp_path / "study", draws=30)
    compared = [a for a in LAMBDAS if a != CONTROL]
    labels = {"snapkv-512": "SnapKV, 512 tokens", "snapkv-half": "SnapKV, half the cache"}
    outputs = {
        f"table{i}": tuple(tmp_path / f"table{i}.{e}" for e in ("csv", "md", "tex", "html"))
        for i in range(1, 5)
    }
    built = write_study_tables(
        est, pred, outputs, compared, "snapkv-512 - snapkv-half", None, labels
    )
    assert [r[1] for r in built["table1"].rows[:3]] == [
        "SnapKV, 512 tokens",
        "SnapKV, half the cache",
        "recent-half",
    ]
    assert built["table1"].data["action"].to_list()[:3] == compared
    assert "SnapKV, 512 tokens - SnapKV, half the cache" in [r[1] for r in built["table2"].rows]
    assert "snapkv-512 - snapkv-half" in built["table2"].data["contrast"].to_list()
    assert any(h.startswith("B: SnapKV, 512 tokens") for h in built["table3"].header)
    assert "SnapKV, 512 tokens - SnapKV, half the cache" in built["table4"].caption
    md = (tmp_path / "table1.md").read_text()
    assert "SnapKV, half the cache" in md and "| snapkv-half |" not in md
    assert pl.read_csv(tmp_path / "table1.csv")["action"].to_list()[:3] == compared


def test_the_sweep_figure_draws_the_pooled_rows_per_model_and_method(swept, tmp_path):
    estimands = read_estimands(swept)
    table = sweep_table(estimands, SWEEP, by_model=True)
    models = estimands["model"].unique(maintain_order=True).to_list()
    assert len(models) == 2
    assert table.height == len(models) * len(SWEEP) * len(SWEEP_ESTIMANDS)
    fig = plot_sweep(table, estimands, "other", "the other method")
    try:
        assert _outside(fig) == []
        assert smallest_font(fig) >= MIN_FONT_PT
        axes = np.array(fig.axes).reshape(len(models), len(SWEEP_ESTIMANDS))
        for row, model in zip(axes, models, strict=True):
            assert row[0].get_title(loc="left") == model
            for ax, (estimand, (_, scale, _)) in zip(row, SWEEP_ESTIMANDS.items(), strict=True):
                lines = [ln for ln in ax.lines if (ln.get_gid() or "").startswith("method:")]
                assert [ln.get_gid() for ln in lines] == ["method:SnapKV", "method:recent+sinks=2"]
                for j, (line, method) in enumerate(
                    zip(lines, ["SnapKV", "recent+sinks=2"], strict=True)
                ):
                    own = [a for a, (m, _) in SWEEP.items() if m == method]
                    rows = estimands.filter(
                        (pl.col("model") == model)
                        & (pl.col("stratum") == "pooled")
                        & (pl.col("contrast") == "")
                        & (pl.col("estimand") == estimand)
                        & pl.col("action").is_in(own)
                    )
                    by_action = dict(zip(rows["action"], rows["value"], strict=True))
                    x = [100 * SWEEP[a][1] for a in own]
                    every = [100 * b for _, b in SWEEP.values()]
                    shift = dodge(j, 2, max(every) - min(every))  # lines dodged a little
                    np.testing.assert_allclose(line.get_xdata(), np.array(x) + shift)
                    np.testing.assert_allclose(
                        line.get_ydata(), [scale * by_action[a] for a in own]
                    )
                base = estimands.filter(
                    (pl.col("model") == model)
                    & (pl.col("stratum") == "pooled")
                    & (pl.col("action") == "other")
                    & (pl.col("estimand") == estimand)
                )["value"][0]
                dashed = [ln for ln in ax.lines if ln.get_gid() == "baseline"]
                assert len(dashed) == 1 and dashed[0].get_ydata()[0] == pytest.approx(scale * base)
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert legend == ["SnapKV", "recent+sinks=2", "baseline the other method"]
    finally:
        plt.close(fig)
    png, pdf = tmp_path / "budget_sweep.png", tmp_path / "budget_sweep.pdf"
    drawn = write_sweep_figure(swept, SWEEP, png, pdf, baseline="sweep@0.5")
    assert drawn.height == table.height and png.stat().st_size > 20_000 and pdf.exists()
    with pytest.raises(StudyTableError) as err:
        write_sweep_figure(swept, SWEEP | {"gone@0.5": ("gone", 0.5)}, png, pdf)
    assert str(err.value) == (
        f"{swept}: no rows for action 'gone@0.5' (needed by the sweep figure)"
    )
