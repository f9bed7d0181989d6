"""Figure 1: occurrence versus occupation, the introductory example.

The reference always emits 0; two interventions emit 1 at the first position with probability
ε and then continue with 0s (``revert``) or repeat their first token (``persist``). Both have
the same first-divergence law and the same sequence TV ε, but R_SMC = ε/H versus ε. Every
number drawn comes from :func:`kvdiverge.theory.risk.introductory_example` and the exact path law of
its kernel pairs (:func:`kvdiverge.theory.risk.exact_path_law`).
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from kvdiverge.plots.base import (  # noqa: E402
    TEXT_WIDTH,
    PercentTicks,
    new_figure,
    save_figure,
    series_styles,
)
from kvdiverge.theory.risk import exact_path_law, introductory_example  # noqa: E402

__all__ = ["introductory_curves", "plot_introductory_example", "write_introductory_figure"]

_LABELS = {"revert": "returns to agreement", "persist": "stays diverged"}
_STYLES = series_styles(list(_LABELS))
_TERMS = {"O_H": ("#E69F00", ""), "Pi_H": ("#56B4E9", "////")}  # as the decomposition's terms


def introductory_curves(eps: float, H: int) -> dict[str, dict[str, np.ndarray | float]]:
    """Exact per-step curves of the introductory example for both interventions.

    Per intervention: ``mismatch`` = P(X_t ≠ Y_t) for t = 1..H, ``div_cdf`` = P(τ ≤ t),
    ``sequence_tv``, ``R_SMC``, ``O_H`` and ``Pi_H`` (exact, from the coupled path law).
    """
    example = introductory_example(eps, H)
    out: dict[str, dict[str, np.ndarray | float]] = {}
    for name, entry in example.items():
        law = exact_path_law(entry["pair"])
        mismatch = law.prob @ (law.x != law.y).astype(np.float64)
        out[name] = {
            "mismatch": mismatch,
            "div_cdf": np.cumsum(entry["p_s"]),
            "sequence_tv": float(entry["sequence_tv"]),
            "R_SMC": float(entry["R_SMC"]),
            "O_H": float(entry["O_H"]),
            "Pi_H": float(entry["Pi_H"]),
        }
    return out


def plot_introductory_example(eps: float, H: int) -> plt.Figure:
    """Figure 1: (a) P(X_t ≠ Y_t) over t, (b) the shared divergence CDF P(τ ≤ t), (c) R_SMC
    split into occurrence O_H and post-divergence component Π_H against the sequence TV ε."""
    curves = introductory_curves(eps, H)
    t = np.arange(1, H + 1)
    fig, axes = new_figure(TEXT_WIDTH, 2.5, 1, 3, gridspec_kw={"width_ratios": [1, 1, 1]})
    ax_m, ax_c, ax_r = axes[0]
    top = 1.15 * eps
    for k, (name, c) in enumerate(curves.items()):
        style = _STYLES[name]
        ax_m.step(
            t,
            c["mismatch"],
            where="mid",
            color=style.color,
            ls=style.linestyle,
            lw=2.2 - 0.9 * k,
            label=_LABELS[name],
        )
        ax_c.step(
            np.concatenate([[0], t]),
            np.concatenate([[0.0], c["div_cdf"]]),
            where="post",
            color=style.color,
            ls=style.linestyle,
            lw=2.2 - 0.9 * k,
            label=_LABELS[name],
        )
    for ax, title, ylabel in (
        (ax_m, "(a) mismatch per step", r"$P(X_t \neq Y_t)$"),
        (ax_c, "(b) first divergence (both)", r"$P(\tau \leq t)$"),
    ):
        ax.set_ylim(-0.02 * top, top)
        ax.set_xlim(0.5, H + 0.5)
        ax.xaxis.set_major_locator(MaxNLocator(6, integer=True))
        ax.yaxis.set_major_formatter(PercentTicks())
        ax.set_xlabel("generation step $t$")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
    ax_m.legend(loc="center right")

    names = list(curves)
    x = np.arange(len(names))
    occurrence = np.array([curves[n]["O_H"] for n in names])
    post = np.array([curves[n]["Pi_H"] for n in names])
    for bottom, values, key, label in (
        (None, occurrence, "O_H", r"occurrence $O_H$"),
        (occurrence, post, "Pi_H", r"post-divergence $\Pi_H$"),
    ):
        color, hatch = _TERMS[key]
        ax_r.bar(
            x,
            values,
            bottom=bottom,
            width=0.55,
            color=color,
            hatch=hatch,
            edgecolor="0.25",
            lw=0.5,
            label=label,
        )
    seq_tv = curves[names[0]]["sequence_tv"]
    ax_r.axhline(seq_tv, color="black", ls=":", lw=1, label=f"sequence TV = ε = {seq_tv:.0%}")
    for i, n in enumerate(names):
        r = curves[n]["R_SMC"]
        closed = {r"$\varepsilon/H$": eps / H, r"$\varepsilon$": eps}
        form = next((f"{k} = " for k, v in closed.items() if abs(r - v) < 1e-12), "")
        ax_r.text(i, r + 0.03 * top, f"{form}{100 * r:.3g}%", ha="center", va="bottom")
    ax_r.set_xticks(x, [_LABELS[n].replace(" ", "\n", 1) for n in names])
    ax_r.set_ylim(0, top * 1.6)
    ax_r.grid(axis="x", visible=False)
    ax_r.yaxis.set_major_formatter(PercentTicks())
    ax_r.set_ylabel(r"$R_{SMC} = O_H + \Pi_H$")
    ax_r.set_title(f"(c) risk $R_{{SMC}}$, H = {H}")
    ax_r.legend(loc="upper left", ncol=1, handlelength=1.6)
    return fig


def write_introductory_figure(
    eps: float, H: int, png: str | os.PathLike, pdf: str | os.PathLike
) -> dict[str, dict[str, np.ndarray | float]]:
    """Draw figure 1 for (ε, H) and write it as PNG and PDF atomically; return its curves."""
    fig = plot_introductory_example(eps, H)
    save_figure(fig, png, pdf)
    return introductory_curves(eps, H)
