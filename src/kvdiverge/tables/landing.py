"""A study's part of the report's landing page (``tables/landing.rst``; workflow/report/
workflow.rst includes it): the answer first.

In order: the study's line (models, documents per stratum of the evaluation cohort, H, the
decoding), the headline table (:func:`kvdiverge.tables.headline.render_headline_rst`: each
action's P(τ ≤ H), E[τ | τ ≤ H], R_SMC and task accuracy with intervals), the contrasts
against the study's baseline (ΔR_SMC, Δ P(τ ≤ H), Δ mean entry time, Δ accuracy with paired
intervals), Figure 5 (the pooled divergence CDFs, embedded so the page is self-contained), the
sentences (:func:`kvdiverge.tables.contrasts.action_sentences`), and what the number of
documents allows (:func:`kvdiverge.tables.headline.accuracy_resolution`, and one document's
weight in an accuracy).
"""

from __future__ import annotations

import base64
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import polars as pl

from kvdiverge.tables.contrasts import action_sentences, labelled, rst_text
from kvdiverge.tables.headline import accuracy_resolution, render_headline_rst
from kvdiverge.tables.study_table import covers_zero

__all__ = ["landing_documents", "render_landing_rst"]

_CONTRAST_HEADINGS = {
    "R_smc": ("ΔR_SMC, pp", 100.0),
    "div_prob": ("Δ P(τ ≤ H), pp", 100.0),
    "mean_entry_time": ("Δ E[τ | τ ≤ H], steps", 1.0),
    "accuracy": ("Δ accuracy (Y), pp", 100.0),
}


def _number(x: float) -> str:
    text = f"{x:.1f}"
    return text.lstrip("-") if float(text) == 0 else text


def _cell(row: Mapping | None, scale: float) -> str:
    if row is None or row["value"] is None or not math.isfinite(row["value"]):
        return "undefined" if row is not None else "—"
    text = _number(scale * row["value"])
    lo, hi = row["ci_low"], row["ci_high"]
    if lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi):
        text += f" [{_number(scale * lo)}, {_number(scale * hi)}]"
        if covers_zero(lo, hi):
            text += " (includes 0)"
    return text


def _contrast_rst(contrasts: pl.DataFrame, model: str, title: str) -> list[str]:
    rows = contrasts.filter(pl.col("model") == model) if "model" in contrasts else contrasts
    if rows.height == 0:
        return []
    level = float(rows["ci_level"][0])
    head = ["action − baseline", *(h for h, _ in _CONTRAST_HEADINGS.values())]
    out = [
        f".. list-table:: {rst_text(title)}, {rst_text(model)}: each action minus the baseline "
        f"(paired {100 * level:g}% intervals)",
        "   :header-rows: 1",
        "",
    ]
    body = [head]
    for (action, baseline), own in rows.group_by(["action", "baseline"], maintain_order=True):
        by = {r["estimand"]: r for r in own.iter_rows(named=True)}
        body.append(
            [f"{action} − {baseline}", *(_cell(by.get(e), s) for e, (_, s) in
                                          _CONTRAST_HEADINGS.items())]
        )  # fmt: skip
    for row in body:
        out.append(f"   * - {rst_text(row[0])}")
        out += [f"     - {rst_text(c)}" for c in row[1:]]
    return [*out, ""]


def _figure_rst(png: str | os.PathLike | None, study: str) -> list[str]:
    if png is None or not Path(png).is_file():
        return []
    # docutils refuses a line over 10,000 characters, and a data URL's base64 may hold
    # whitespace (browsers drop it), so the image goes in lines of 76 characters
    data = base64.encodebytes(Path(png).read_bytes()).decode().replace("\n", "\n   ")
    alt = (
        f"Figure 5 of {study}: the probability that the evicted-cache generation has diverged "
        "by step t"
    )
    return [
        ".. raw:: html",
        "",
        f'   <figure class="kvdiverge-fig5"><img alt="{alt}" style="max-width: 100%" '
        f'src="data:image/png;base64,{data}"><figcaption>{alt}, per action, all strata pooled, '
        "with pointwise intervals; a lower curve diverges later.</figcaption></figure>",
        "",
    ]


def render_landing_rst(
    study: str,
    headline: pl.DataFrame,
    contrasts: pl.DataFrame | None,
    *,
    H: int,
    temperature: float,
    documents: Mapping[str, int],
    labels: Mapping[str, str] | None = None,
    figure: str | os.PathLike | None = None,
    registration: str | None = None,
) -> str:
    """The landing-page text of ``study`` (module docstring). ``headline``:
    :func:`kvdiverge.tables.headline.headline_table`'s rows (every model); ``contrasts``: the
    study's ``contrasts.csv`` table (None without a baseline); ``documents``: evaluation
    documents per stratum; ``figure``: Figure 5's PNG."""
    decoding = "greedy decoding" if temperature == 0 else f"temperature {temperature:g}"
    per = ", ".join(f"{n} in {s}" for s, n in documents.items())
    total = sum(documents.values())
    models = headline["model"].unique(maintain_order=True).to_list()
    lines = [
        f"**{rst_text(study)}** — {rst_text(', '.join(map(str, models)))}; {total} evaluation "
        f"documents ({rst_text(per)}), H = {H} generated tokens, {decoding}.",
        "",
        render_headline_rst(headline, labels, title=study),
    ]
    shown = labelled(contrasts, labels) if contrasts is not None else None
    for model in models:
        if shown is not None:
            lines += _contrast_rst(shown, str(model), study)
    lines += _figure_rst(figure, study)
    if shown is not None:
        for model in models:
            rows = shown.filter(pl.col("model") == model) if "model" in shown else shown
            pairs = rows.group_by(["action", "baseline"], maintain_order=True)
            for (action, baseline), own in pairs:
                said = action_sentences(own, action, baseline, H, "each source's metric")
                lines.append(f"- {rst_text(model)}: {rst_text(' '.join(said))}")
            lines.append("")
    weight = 100 / total if total else float("nan")
    note = accuracy_resolution(contrasts, total) if contrasts is not None else None
    lines.append(
        f"What {total} documents allow: "
        + (
            note
            if note
            else f"one document moves an action's pooled accuracy by {weight:.0f} points, and "
            "every interval above is over documents."
        )
    )
    if registration:
        lines += ["", f"*{rst_text(registration)}*"]
    return "\n".join(lines) + "\n"


def landing_documents(estimands: pl.DataFrame, strata: Sequence[str]) -> dict[str, int]:
    """Evaluation documents per stratum, from the estimands table's ``n_docs`` (the largest of
    a stratum's rows)."""
    out = {}
    for s in strata:
        rows = estimands.filter(pl.col("stratum") == s)["n_docs"].drop_nulls()
        if rows.len():
            out[s] = int(rows.max())
    return out
