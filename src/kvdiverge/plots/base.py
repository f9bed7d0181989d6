"""The house style of every figure, and atomic PNG + PDF output.

Every figure of the package (figure 1, the finite-state figures, the study figures) is drawn
under :func:`house_style` at its print size: :data:`COLUMN_WIDTH` for a single-column figure,
:data:`TEXT_WIDTH` for a full-width one, with no text smaller than :data:`MIN_FONT_PT` points.
Figures use matplotlib's constrained layout and are saved without cropping, so the file's size
is the print size. Series (actions, estimators, terms) take their colour, line style, marker
and hatch from :func:`series_styles`: the Okabe–Ito colour-blind-safe colours, ordered so that
the first two are the high-contrast blue/vermillion pair, each doubled by a line style, marker
and hatch so that series stay apart in greyscale and where intervals overlap.
"""

from __future__ import annotations

import logging
import math
import os
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")
# The PDF backend subsets fonts with fontTools, which logs every table it subsets at INFO level
# into the figure jobs' logs: only its warnings are kept.
logging.getLogger("fontTools").setLevel(logging.WARNING)

import matplotlib.legend  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from matplotlib.ticker import Formatter  # noqa: E402

from kvdiverge.io import atomic_path  # noqa: E402

__all__ = [
    "COLUMN_WIDTH",
    "CONTROL_STYLE",
    "DPI",
    "MIN_FONT_PT",
    "TEXT_WIDTH",
    "PercentTicks",
    "SeriesStyle",
    "empty_panel",
    "figure_legend",
    "house_style",
    "interval_band",
    "new_figure",
    "save_figure",
    "series_styles",
    "smallest_font",
    "tick_decimals",
]

COLUMN_WIDTH = 3.4
"""Width (inches) of a single-column figure: one column of a two-column paper."""
TEXT_WIDTH = 7.0
"""Width (inches) of a full-width figure (``figure*``)."""
MIN_FONT_PT = 8.0
"""The smallest text size (points) of any figure at its print size."""
DPI = 300
"""Resolution of the PNG files."""

# Okabe & Ito's colour-blind-safe colours; blue and vermillion first: the highest-contrast pair
_COLORS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442")
_LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)), (0, (3, 1, 1, 1)))
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "h")
_HATCHES = ("", "////", "\\\\\\\\", "xx", "....", "++")


@dataclass(frozen=True)
class SeriesStyle:
    """How one series is drawn: colour, line style, marker and (for bars and bands) hatch."""

    color: str
    linestyle: str | tuple = "-"
    marker: str = "o"
    hatch: str = ""

    def line(self) -> dict:
        """Keyword arguments of ``ax.plot`` for this series."""
        return {"color": self.color, "linestyle": self.linestyle}


CONTROL_STYLE = SeriesStyle("#7F7F7F", ":", "x", "")
"""The full-retention control: grey, dotted."""


def series_styles(names: Sequence[str], control: str | None = None) -> dict[str, SeriesStyle]:
    """One :class:`SeriesStyle` per name, by position (the first two are blue and vermillion,
    solid and dashed); ``control`` gets :data:`CONTROL_STYLE` and takes no position."""
    styles, k = {}, 0
    for name in names:
        if name == control:
            styles[name] = CONTROL_STYLE
            continue
        styles[name] = SeriesStyle(
            _COLORS[k % len(_COLORS)],
            _LINESTYLES[k % len(_LINESTYLES)],
            _MARKERS[k % len(_MARKERS)],
            _HATCHES[k % len(_HATCHES)],
        )
        k += 1
    return styles


def house_style() -> None:
    """Set the style of every figure: seaborn's white grid, text of at least
    :data:`MIN_FONT_PT` points, thin rules, TrueType fonts in the PDF."""
    sns.set_theme(
        style="whitegrid",
        context="paper",
        rc={
            "font.size": MIN_FONT_PT,
            "axes.titlesize": 9,
            "axes.labelsize": MIN_FONT_PT,
            "xtick.labelsize": MIN_FONT_PT,
            "ytick.labelsize": MIN_FONT_PT,
            "legend.fontsize": MIN_FONT_PT,
            "legend.title_fontsize": MIN_FONT_PT,
            "figure.titlesize": 9,
            "axes.titlelocation": "left",
            "axes.linewidth": 0.6,
            "axes.edgecolor": "0.3",
            "grid.linewidth": 0.5,
            "grid.color": "0.88",
            "lines.linewidth": 1.3,
            "lines.markersize": 4,
            "errorbar.capsize": 2,
            "hatch.linewidth": 0.6,
            "legend.frameon": False,
            "legend.handlelength": 2.6,
            "xtick.major.pad": 2,
            "ytick.major.pad": 2,
            "axes.labelpad": 2,
            "pdf.fonttype": 42,
            "ps.fonttype": 42,
            "figure.dpi": 100,
            "savefig.dpi": DPI,
        },
    )


def new_figure(
    width: float, height: float, nrows: int = 1, ncols: int = 1, **kwargs
) -> tuple[plt.Figure, np.ndarray]:
    """A figure of ``width`` × ``height`` inches (its print size) under :func:`house_style`,
    with constrained layout and a 2-D array of axes (``plt.subplots`` keyword arguments pass)."""
    house_style()
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(width, height), layout="constrained", squeeze=False, **kwargs
    )
    fig.get_layout_engine().set(w_pad=0.02, h_pad=0.02, wspace=0.03, hspace=0.04)
    return fig, axes


def empty_panel(ax: plt.Axes, note: str, xlabel: str | None = None) -> None:
    """A panel with nothing to draw (every value 0 or undefined): ``note`` says so in its
    centre instead of a plot of zeros; no ticks, no grid, the axis label kept."""
    ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(visible=False)
    if xlabel is not None:
        ax.set_xlabel(xlabel)


def tick_decimals(values: Iterable[float], scale: float = 100.0, most: int = 4) -> int:
    """The fewest decimals (at most ``most``) that show every value × ``scale`` exactly."""
    shown = [v * scale for v in values if v is not None and math.isfinite(v)]
    for decimals in range(most + 1):
        if all(abs(round(v, decimals) - v) < 1e-9 * max(1.0, abs(v)) for v in shown):
            return decimals
    return most


class PercentTicks(Formatter):
    """Fractions as percent tick labels that never round a tick: the decimals are the fewest
    that show every tick of the axis exactly (−2.5 stays −2.5), the same for all of them.
    ``symbol`` follows the number ("%" for percent, "" for percentage points); no "−0"."""

    def __init__(self, symbol: str = "%") -> None:
        self.symbol = symbol
        self.decimals = 0

    def _text(self, x: float) -> str:
        text = f"{100 * x:.{self.decimals}f}"
        if float(text) == 0:
            text = text.lstrip("-")
        return text.replace("-", "\N{MINUS SIGN}") + self.symbol

    def format_ticks(self, values):
        self.decimals = tick_decimals(values)
        return [self._text(v) for v in values]

    def __call__(self, x, pos=None):
        return self._text(x)


def interval_band(
    ax: plt.Axes, x, low, high, style: SeriesStyle, step: bool = False, alpha: float = 0.12
) -> None:
    """A pointwise interval as a light fill *and* its two edges drawn thin in the series' colour
    and line style, so that overlapping bands stay attributable (steps for a CDF)."""
    where = "post" if step else None
    ax.fill_between(x, low, high, color=style.color, alpha=alpha, lw=0, step=where, zorder=1)
    for edge in (low, high):
        ax.plot(
            x,
            edge,
            color=style.color,
            linestyle=style.linestyle,
            lw=0.6,
            alpha=0.8,
            drawstyle="steps-post" if step else "default",
            zorder=1.5,
        )


_LEGEND_ROOM = 0.6
"""Inches of legend a figure's own height already allows for (a title and two rows); a taller
legend makes the figure taller by the excess, so the panels keep their size."""


def _legend_width(legend: matplotlib.legend.Legend, fig: plt.Figure) -> float:
    return legend.get_window_extent(fig.canvas.get_renderer()).width


def figure_legend(
    fig: plt.Figure, handles: Sequence, labels: Sequence[str], title: str | None = None, **kw
) -> matplotlib.legend.Legend:
    """The figure's one legend, above the panels, outside them (constrained layout), fitted to
    the figure's width: with fewer columns than ``ncol`` where the entries are too wide, and
    with long labels and title wrapped onto several lines where even one column is; a legend
    taller than :data:`_LEGEND_ROOM` makes the figure taller by the excess."""
    labels = [str(label) for label in labels]
    ncol = max(1, min(kw.pop("ncol", min(len(labels), 4)), len(labels)))
    room = 0.96 * fig.get_figwidth() * fig.dpi

    def draw(labels: Sequence[str], title: str | None, ncol: int) -> matplotlib.legend.Legend:
        return fig.legend(
            handles,
            labels,
            loc="outside upper center",
            ncol=ncol,
            title=title,
            columnspacing=1.2,
            handletextpad=0.5,
            **kw,
        )

    legend = draw(labels, title, ncol)
    while _legend_width(legend, fig) > room and ncol > 1:
        legend.remove()
        ncol -= 1
        legend = draw(labels, title, ncol)
    width = _legend_width(legend, fig)
    if width > room:  # one column is still too wide: wrap the long texts
        legend.remove()
        chars = max(12, int(max(map(len, [*labels, title or ""])) * room / width) - 2)
        labels = [textwrap.fill(label, chars, break_on_hyphens=False) for label in labels]
        title = textwrap.fill(title, chars) if title else title
        legend = draw(labels, title, ncol)
    height = legend.get_window_extent(fig.canvas.get_renderer()).height / fig.dpi
    if height > _LEGEND_ROOM:
        fig.set_figheight(fig.get_figheight() + height - _LEGEND_ROOM)
    return legend


def smallest_font(fig: plt.Figure) -> float:
    """The smallest size (points) of any visible, non-empty text of ``fig`` once drawn."""
    fig.canvas.draw()
    sizes = [
        t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()
    ]
    return min(sizes) if sizes else math.inf


SAVE_METADATA: dict[str, dict[str, None]] = {"png": {}, "pdf": {"CreationDate": None}}
"""Per format, the metadata :func:`save_figure` passes to ``savefig``: PDFs without their
creation date, so that a rerun writes byte-identical figures (PNGs carry no date)."""


def save_figure(fig: plt.Figure, png: str | os.PathLike, pdf: str | os.PathLike) -> None:
    """Write ``fig`` atomically as PNG (:data:`DPI`) and PDF at its print size, then close it;
    the same figure gives the same bytes on every run (:data:`SAVE_METADATA`)."""
    for target, fmt in ((png, "png"), (pdf, "pdf")):
        with atomic_path(target) as tmp:
            fig.savefig(tmp, format=fmt, dpi=DPI, metadata=SAVE_METADATA[fmt])
    plt.close(fig)
