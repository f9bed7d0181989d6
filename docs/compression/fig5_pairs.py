"""Figure 5 of configs/compression.yaml's run in four panels, one per comparison of
docs/compression.md's reading, from the run's estimands.csv (each panel drawn by
kvdiverge.plots.study.plot_divergence_cdf with its own actions, so each has few enough curves
to tell apart; the panels are put side by side pixel for pixel).

    python docs/compression/fig5_pairs.py results/compression/study1/tables/estimands.csv \
        docs/compression/fig5_divergence_cdf_pairs.png
"""

from __future__ import annotations

import io
import sys

import matplotlib.pyplot as plt
import numpy as np
from PIL import Image

from kvdiverge.plots.base import DPI, SAVE_METADATA, series_styles
from kvdiverge.plots.study import plot_divergence_cdf
from kvdiverge.tables import read_estimands

PANELS = {
    "(a) 4 bits and SnapKV at equal bytes": ["kivi-4bit", "snapkv-24", "quanto-4bit", "snapkv-157"],
    "(b) 2 bits and SnapKV at equal bytes": [
        "kivi-2bit",
        "snapkv-18",
        "kivi-2bit-r0",
        "kivi-2bit-gen",
        "snapkv-138",
    ],
    "(c) merging at SnapKV-24's budget": ["merging-24", "snapkv-24"],
    "(d) compression during decoding": ["decoding-knorm", "streaming-192", "snapkv-24"],
}


def panel_png(table, title: str, actions: list[str]) -> np.ndarray:
    """One panel as RGB pixels: the actions' pooled CDFs, styled by their order here."""
    fig = plot_divergence_cdf(table, actions, series_styles(actions))
    fig.axes[0].set_title(title)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, metadata=SAVE_METADATA["png"])
    plt.close(fig)
    buffer.seek(0)
    return np.asarray(Image.open(buffer).convert("RGB"))


def main(estimands: str, out: str) -> None:
    table = read_estimands(estimands)
    panels = [panel_png(table, title, actions) for title, actions in PANELS.items()]
    height = max(p.shape[0] for p in panels)
    width = max(p.shape[1] for p in panels)
    padded = []
    for p in panels:  # white below and to the right of a smaller panel
        canvas = np.full((height, width, 3), 255, dtype=np.uint8)
        canvas[: p.shape[0], : p.shape[1]] = p
        padded.append(canvas)
    grid = np.vstack([np.hstack(padded[:2]), np.hstack(padded[2:])])
    Image.fromarray(grid).save(out, dpi=(DPI, DPI))


if __name__ == "__main__":
    main(*sys.argv[1:3])
