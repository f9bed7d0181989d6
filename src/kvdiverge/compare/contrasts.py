"""``kvdiverge compare --baseline``: every action minus the baseline, with paired bootstrap
intervals, as a table, a figure and plain sentences.

The timing contrasts are the estimands table's own contrast rows ``action - baseline``
(:func:`kvdiverge.analysis.estimands.contrast_estimands`: ΔR_SMC, Δ P(τ ≤ H), Δ mean entry time
E[τ | τ ≤ H], and the gap decomposition ΔR_SMC = occurrence + exposure + rate terms with their
shares). Δ accuracy (the task accuracy of the action's generations Y minus the baseline's) is
drawn here under the very bootstrap weights the estimands table uses (documents ordered by
stratum and doc_id, :func:`kvdiverge.analysis.bootstrap.stratified_bootstrap_weights` with the
same seed and draws), so every interval of a row of ``contrasts.csv`` comes from the same
resampled documents.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import polars as pl

from kvdiverge.analysis.bootstrap import percentile_interval, stratified_bootstrap_weights
from kvdiverge.compare.actions import CompareError

__all__ = [
    "CONTRAST_ESTIMANDS",
    "accuracy_contrasts",
    "baseline_contrasts",
    "contrast_sentences",
    "plot_contrasts",
    "render_contrasts",
    "write_contrast_outputs",
]

CONTRAST_ESTIMANDS = {
    "R_smc": "ΔR_SMC (share of steps whose tokens differ from the full cache's)",
    "div_prob": "Δ P(τ ≤ H) (paths that diverge within H steps)",
    "mean_entry_time": "Δ mean entry time E[τ | τ ≤ H] (steps)",
    "gap_occurrence": "occurrence term of ΔR_SMC (ΔO_H)",
    "gap_exposure": "exposure term of ΔR_SMC (ΔE_H · mean C_H)",
    "gap_rate": "rate term of ΔR_SMC (ΔC_H · mean E_H)",
    "occurrence_share": "occurrence share of ΔR_SMC",
    "exposure_share": "exposure share of ΔR_SMC",
    "rate_share": "rate share of ΔR_SMC",
    "accuracy": "Δ task accuracy of the generations Y",
}
"""The estimands of ``contrasts.csv``, in order, with their descriptions."""

CONTRAST_COLUMNS = (
    "action",
    "baseline",
    "estimand",
    "description",
    "value",
    "ci_low",
    "ci_high",
    "ci_level",
    "action_value",
    "baseline_value",
    "n_docs",
    "draws_dropped",
)
_OWN = ("R_smc", "div_prob", "mean_entry_time")


def _weights(stats: pl.DataFrame, action: str, draws: int, seed: int) -> tuple[list, np.ndarray]:
    """Documents in the estimands table's order and its bootstrap weights (draw 0: the sample)."""
    docs = stats.filter(pl.col("action") == action).sort("stratum", "doc_id")
    boot = stratified_bootstrap_weights(
        docs["stratum"].to_numpy(), draws, np.random.SeedSequence(seed)
    )
    return docs["doc_id"].to_list(), np.vstack([np.ones((1, docs.height)), boot])


def accuracy_contrasts(
    stats: pl.DataFrame,
    acc_stats: pl.DataFrame,
    actions: Sequence[str],
    baseline: str,
    *,
    draws: int,
    seed: int,
    level: float,
) -> pl.DataFrame:
    """Δ accuracy (``acc_y`` document means, action minus baseline) per action, with the paired
    percentile interval under the estimands table's weights (module docstring)."""
    doc_ids, weights = _weights(stats, baseline, draws, seed)

    def acc(action: str) -> np.ndarray:
        rows = acc_stats.filter(pl.col("action") == action)
        by_doc = dict(zip(rows["doc_id"], rows["acc_y"], strict=True))
        return np.array([by_doc[d] for d in doc_ids], dtype=np.float64)

    means = {a: weights @ acc(a) / weights.sum(1) for a in actions}
    out = []
    for action in actions:
        if action == baseline:
            continue
        diff = means[action] - means[baseline]
        low, high = percentile_interval(diff[None, 1:], level, axis=1)
        out.append(
            {
                "action": action,
                "baseline": baseline,
                "estimand": "accuracy",
                "value": float(diff[0]),
                "ci_low": float(low[0]),
                "ci_high": float(high[0]),
                "ci_level": level,
                "action_value": float(means[action][0]),
                "baseline_value": float(means[baseline][0]),
                "n_docs": len(doc_ids),
                "draws_dropped": int((~np.isfinite(diff[1:])).sum()),
            }
        )
    return pl.DataFrame(out)


def _timing_rows(estimands: pl.DataFrame, actions: Sequence[str], baseline: str) -> pl.DataFrame:
    pooled = estimands.filter(pl.col("stratum") == "pooled")
    own = pooled.filter((pl.col("contrast") == "") & pl.col("estimand").is_in(_OWN))
    own_value = {(a, e): v for a, e, v in own.select("action", "estimand", "value").rows()}
    rows = []
    for action in actions:
        if action == baseline:
            continue
        contrast = f"{action} - {baseline}"
        found = pooled.filter(pl.col("contrast") == contrast)
        if found.height == 0:
            raise CompareError(f"estimands: no contrast rows {contrast!r}")
        for r in found.filter(pl.col("estimand").is_in(list(CONTRAST_ESTIMANDS))).iter_rows(
            named=True
        ):
            rows.append(
                r
                | {
                    "action": action,
                    "baseline": baseline,
                    "action_value": own_value.get((action, r["estimand"])),
                    "baseline_value": own_value.get((baseline, r["estimand"])),
                }
            )
    return pl.DataFrame(rows)


def _sentence_number(x: float, digits: int, scale: float = 1.0) -> str:
    text = f"{scale * x:.{digits}f}"
    return text.lstrip("-") if float(text) == 0 else text


def _directed(
    value: float,
    low: float,
    high: float,
    words: tuple[str, str],
    other: str,
    digits: int,
    scale: float = 1.0,
) -> str:
    """``|value| word than other [interval]``, the interval turned to the sentence's direction
    ("7.0 steps earlier than snapkv [3.9, 12.2]"); "the same as other" for an exact 0."""
    finite = math.isfinite(low) and math.isfinite(high)
    if value == 0 and (not finite or low == high == 0):
        return f"the same as {other}" + (" [0, 0]" if finite else "")
    if value < 0:
        value, low, high = -value, -high, -low
        word = words[1]
    else:
        word = words[0]
    interval = (
        f"[{_sentence_number(low, digits, scale)}, {_sentence_number(high, digits, scale)}]"
        if finite
        else "[interval undefined]"
    )
    text = f"{_sentence_number(value, digits, scale)} {word} than {other} {interval}"
    if finite and low <= 0 <= high:
        text += " (the interval includes 0)"
    return text


def contrast_sentences(table: pl.DataFrame, H: int, metric: str, temperature: float) -> str:
    """``summary.md``: plain sentences, one paragraph per action against the baseline."""
    if table.height == 0:
        return ""
    level = float(table["ci_level"][0])
    n_docs = int(table["n_docs"][0])
    decoding = "greedy decoding" if temperature == 0 else f"temperature {temperature:g}"
    lines = [
        "# Against the baseline",
        "",
        f"{n_docs} prompts, H = {H} generated tokens, {decoding}; brackets are paired "
        f"{100 * level:g}% document-bootstrap intervals of the difference.",
        "",
    ]
    for (action, baseline), rows in table.group_by(["action", "baseline"], maintain_order=True):
        by = {r["estimand"]: r for r in rows.iter_rows(named=True)}
        out = []
        p = by["div_prob"]
        other = f"{baseline} ({100 * p['baseline_value']:.0f}%)"
        more = _directed(
            p["value"], p["ci_low"], p["ci_high"], ("points more", "points fewer"), other, 1, 100
        )
        out.append(
            f"{action} diverges from the full-cache model within H = {H} steps on "
            f"{100 * p['action_value']:.0f}% of paths, {more}."
        )
        e = by["mean_entry_time"]
        if math.isfinite(e["value"]):
            when = _directed(
                e["value"], e["ci_low"], e["ci_high"], ("steps later", "steps earlier"), baseline, 1
            )
            out.append(
                f"{action} diverges {when}, by the mean first divergence step τ of the paths that "
                "diverge."
            )
        else:
            out.append(
                f"The mean entry time is undefined: {action} or {baseline} never diverges here."
            )
        r = by["R_smc"]
        other = f"{baseline}'s ({r['baseline_value']:.3f})"
        gap = _directed(r["value"], r["ci_low"], r["ci_high"], ("higher", "lower"), other, 3)
        out.append(
            f"{action}'s R_SMC (the share of steps whose token differs from the full cache's) is "
            f"{r['action_value']:.3f}, {gap}."
        )
        shares = [100 * by[f"{t}_share"]["value"] for t in ("occurrence", "exposure", "rate")]
        if r["value"] != 0 and all(math.isfinite(s) for s in shares):
            out.append(
                "Of that gap, occurrence (paths that diverge at all) accounts for "
                f"{shares[0]:.0f}%, exposure (how long after divergence) {shares[1]:.0f}% "
                f"and rate (how often tokens differ after divergence) {shares[2]:.0f}%."
            )
        a = by.get("accuracy")
        if a is not None and a["action_value"] == a["baseline_value"] == 0:
            out.append(
                f"No generation of {action} or {baseline} answers correctly ({metric}: 0% for "
                "both), so task accuracy does not tell them apart here."
            )
        elif a is not None:
            other = f"{baseline}'s ({100 * a['baseline_value']:.0f}%)"
            words = ("points higher", "points lower")
            acc = _directed(a["value"], a["ci_low"], a["ci_high"], words, other, 1, 100)
            out.append(
                f"Task accuracy ({metric}) of {action}'s generations is "
                f"{100 * a['action_value']:.0f}%, {acc}."
            )
        lines += [f"## {action} against {baseline}", "", " ".join(out), ""]
    return "\n".join(lines)


def baseline_contrasts(
    estimands: pl.DataFrame,
    stats: pl.DataFrame,
    acc_stats: pl.DataFrame,
    actions: Sequence[str],
    baseline: str,
    *,
    H: int,
    metric: str,
    draws: int,
    seed: int,
    level: float,
    temperature: float,
) -> tuple[pl.DataFrame, str]:
    """``contrasts.csv``'s table (:data:`CONTRAST_COLUMNS`, :data:`CONTRAST_ESTIMANDS` per action)
    and ``summary.md``'s text."""
    timing = _timing_rows(estimands, actions, baseline)
    acc = accuracy_contrasts(
        stats, acc_stats, actions, baseline, draws=draws, seed=seed, level=level
    )
    order = {e: i for i, e in enumerate(CONTRAST_ESTIMANDS)}
    rank = {a: i for i, a in enumerate(actions)}
    table = (
        pl.concat(
            [
                timing.select([c for c in CONTRAST_COLUMNS if c != "description"]),
                acc.select([c for c in CONTRAST_COLUMNS if c != "description"]),
            ],
            how="vertical_relaxed",
        )
        .with_columns(
            description=pl.col("estimand").replace_strict(CONTRAST_ESTIMANDS),
            _a=pl.col("action").replace_strict(rank),
            _e=pl.col("estimand").replace_strict(order),
        )
        .sort("_a", "_e")
        .select(CONTRAST_COLUMNS)
    )
    return table, contrast_sentences(table, H, metric, temperature)


def render_contrasts(table: pl.DataFrame) -> str:
    """``contrasts.md``: one row per action and estimand, the interval beside the value."""

    def fmt(x: float | None, estimand: str) -> str:
        if x is None or not math.isfinite(x):
            return "NA"
        return f"{x:.2f}" if estimand == "mean_entry_time" else f"{x:.4f}"

    lines = [
        "| action | baseline | estimand | difference | interval | level | action | baseline "
        "| docs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table.iter_rows(named=True):
        e = r["estimand"]
        lines.append(
            f"| {_md(r['action'])} | {_md(r['baseline'])} | {r['description']} | "
            f"{fmt(r['value'], e)} | [{fmt(r['ci_low'], e)}, {fmt(r['ci_high'], e)}] | "
            f"{r['ci_level']:.5g} | {fmt(r['action_value'], e)} | {fmt(r['baseline_value'], e)} | "
            f"{r['n_docs']} |"
        )
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    return text.replace("|", "\\|")


_PANELS = (
    ("R_smc", r"$\Delta R_{\mathrm{SMC}}$, pp", 100.0),
    ("div_prob", r"$\Delta P(\tau \leq H)$, pp", 100.0),
    ("mean_entry_time", r"$\Delta E[\tau \mid \tau \leq H]$, steps", 1.0),
    ("accuracy", r"$\Delta$ task accuracy, pp", 100.0),
)


def _empty_panel_note(rows: pl.DataFrame, estimand: str) -> str | None:
    """Why a panel of the contrast figure has nothing to show, or None: every difference
    undefined, or (accuracy) every action and the baseline at 0."""
    finite = [v for v in rows["value"].to_list() if v is not None and math.isfinite(v)]
    if not finite:
        return "undefined for every action\n(no divergence to time)"
    sides = [*rows["action_value"].to_list(), *rows["baseline_value"].to_list()]
    if estimand == "accuracy" and all(v == 0 for v in sides):
        return (
            "no generation answers\ncorrectly (accuracy 0%\nfor every action):\nnothing to compare"
        )
    return None


def plot_contrasts(table: pl.DataFrame, styles: dict | None = None):
    """The contrast figure: one panel per headline difference (ΔR_SMC, Δ P(τ ≤ H), Δ mean
    entry time, Δ accuracy), one row per action, point and paired interval, zero marked; the
    actions' names are the rows' labels (left of the first panel), the baseline in the title."""
    from kvdiverge.plots.base import TEXT_WIDTH, new_figure, series_styles

    actions = table["action"].unique(maintain_order=True).to_list()
    baseline = table["baseline"][0]
    styles = styles or series_styles([baseline, *actions])
    lines = sum(1 + len(a) // 25 for a in actions)
    height = 1.4 + 0.2 * lines + 0.1 * len(actions)
    fig, axes = new_figure(TEXT_WIDTH, height, 1, len(_PANELS), sharey=True)
    for ax, (estimand, label, scale) in zip(axes[0], _PANELS, strict=True):
        rows = table.filter(pl.col("estimand") == estimand)
        values = {r["action"]: r for r in rows.iter_rows(named=True)}
        note = _empty_panel_note(rows, estimand)
        if note is not None:  # nothing to draw: say so instead of plotting zeros
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, wrap=True)
            ax.set_xticks([])
            ax.set_xlabel(label)
            ax.grid(visible=False)
            continue
        for i, action in enumerate(actions):
            r = values.get(action)
            if r is None or r["value"] is None or not math.isfinite(r["value"]):
                ax.text(0, i, "undefined", ha="center", va="center", color="0.4")
                continue
            v, lo, hi = (scale * r[k] for k in ("value", "ci_low", "ci_high"))
            err = [[v - lo], [hi - v]] if math.isfinite(lo) and math.isfinite(hi) else None
            style = styles[action]
            ax.errorbar([v], [i], xerr=err, fmt=style.marker, color=style.color, ms=5, capsize=2.5)
        ax.axvline(0, color="black", lw=0.8, zorder=1)
        ax.set_xlabel(label)
        ax.grid(axis="y", visible=False)
        ax.margins(x=0.15)
    wrapped = [textwrap.fill(a, 24, break_on_hyphens=False) for a in actions]
    axes[0][0].set_yticks(range(len(actions)), wrapped)
    axes[0][0].set_ylim(len(actions) - 0.5, -0.5)
    level = float(table["ci_level"][0])
    title = textwrap.fill(f"each action minus the baseline {baseline}", 90)
    fig.suptitle(f"{title}\n(paired {100 * level:g}% document-bootstrap intervals)")
    return fig


def write_contrast_outputs(
    table: pl.DataFrame,
    summary: str,
    estimands: pl.DataFrame,
    actions: Sequence[str],
    baseline: str,
    root: Path,
) -> None:
    """``contrasts.{csv,md}``, ``summary.md``, ``contrasts.{png,pdf}`` and the decomposition
    bars ``decomposition.{png,pdf}`` (:func:`kvdiverge.plots.study.plot_decomposition`)."""
    from kvdiverge.io import atomic_path, atomic_write_text
    from kvdiverge.plots.base import save_figure, series_styles
    from kvdiverge.plots.study import plot_decomposition

    with atomic_path(root / "contrasts.csv", suffix=".csv") as tmp:
        table.write_csv(tmp)
    atomic_write_text(root / "contrasts.md", render_contrasts(table))
    atomic_write_text(root / "summary.md", summary)
    styles = series_styles(list(actions))
    save_figure(plot_contrasts(table, styles), root / "contrasts.png", root / "contrasts.pdf")
    contrasts = [f"{a} - {baseline}" for a in actions if a != baseline]
    save_figure(
        plot_decomposition(estimands, contrasts, "estimands"),
        root / "decomposition.png",
        root / "decomposition.pdf",
    )
