"""What every figure shares: the paper theme and atomic PNG + PDF output."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402

from kvdiverge.io import atomic_path  # noqa: E402

__all__ = ["paper_theme", "save_figure"]


def paper_theme() -> None:
    """The seaborn theme of every figure (white grid, paper context)."""
    sns.set_theme(style="whitegrid", context="paper")


def save_figure(fig: plt.Figure, png: str | os.PathLike, pdf: str | os.PathLike) -> None:
    """Write ``fig`` atomically as PNG (200 dpi) and PDF, then close it."""
    for target, fmt in ((png, "png"), (pdf, "pdf")):
        with atomic_path(target) as tmp:
            fig.savefig(tmp, format=fmt, dpi=200, bbox_inches="tight")
    plt.close(fig)
