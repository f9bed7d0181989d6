"""Each action minus a baseline (``kvdiverge compare --baseline``; a study's ``baseline`` in the
pipeline's config, rule study_contrasts), with paired bootstrap intervals, as a table and plain
sentences; :mod:`kvdiverge.compare.contrasts` draws the figures.

The timing contrasts are the estimands table's own contrast rows ``action - baseline``
(:func:`kvdiverge.analysis.estimands.contrast_estimands`: ΔR_SMC, Δ P(τ ≤ H), Δ mean entry time
E[τ | τ ≤ H], and the gap decomposition ΔR_SMC = occurrence + exposure + rate terms with their
shares). Δ accuracy (the task accuracy of the action's generations Y minus the baseline's) is
drawn here under the very bootstrap weights the estimands table uses (documents ordered by
stratum and doc_id, :func:`kvdiverge.analysis.bootstrap.stratified_bootstrap_weights` with the
same seed and draws), so every interval of a row of ``contrasts.csv`` comes from the same
resampled documents.

Namesakes by layer: :mod:`kvdiverge.plots.contrasts` draws a study's figures 6 and 7 (branch
endpoints, gap decompositions), not these contrasts.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence

import numpy as np
import polars as pl

from kvdiverge.analysis.bootstrap import percentile_interval, stratified_bootstrap_weights
from kvdiverge.tables.headline import accuracy_resolution
from kvdiverge.tables.study_table import covers_zero

__all__ = [
    "CONTRAST_COLUMNS",
    "GREEDY_NOTE",
    "CONTRAST_ESTIMANDS",
    "accuracy_contrasts",
    "action_sentences",
    "baseline_contrasts",
    "contrast_sentences",
    "contrast_pairs_of",
    "contrast_table",
    "decomposition_sentence",
    "render_contrasts",
    "render_summary_html",
    "render_summary_rst",
    "rst_text",
    "study_contrasts",
    "summary_paragraphs",
    "write_study_contrasts",
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


def contrast_pairs_of(
    actions: Sequence[str], baseline: str | Mapping[str, str]
) -> list[tuple[str, str]]:
    """(action, its baseline) in the order of ``actions``: every action but ``baseline``
    against it, or, for a mapping (action → baseline: a paired budget grid, each action
    against the baseline at its own budget), the actions it names."""
    if isinstance(baseline, str):
        return [(a, baseline) for a in actions if a != baseline]
    return [(a, baseline[a]) for a in actions if a in baseline]


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
    baseline: str | Mapping[str, str],
    *,
    draws: int,
    seed: int,
    level: float,
) -> pl.DataFrame:
    """Δ accuracy (``acc_y`` document means, action minus baseline) per action, with the paired
    percentile interval under the estimands table's weights (module docstring); ``baseline``
    as in :func:`contrast_pairs_of`."""
    pairs = contrast_pairs_of(actions, baseline)
    doc_ids, weights = _weights(stats, pairs[0][1], draws, seed)

    def acc(action: str) -> np.ndarray:
        rows = acc_stats.filter(pl.col("action") == action)
        by_doc = dict(zip(rows["doc_id"], rows["acc_y"], strict=True))
        missing = [d for d in doc_ids if d not in by_doc]
        if missing:
            raise ValueError(
                f"accuracy: {action!r} has no accuracy row for {len(missing)} document(s) of the "
                f"estimands (e.g. {missing[0]!r})"
            )
        return np.array([by_doc[d] for d in doc_ids], dtype=np.float64)

    means = {a: weights @ acc(a) / weights.sum(1) for pair in pairs for a in pair}
    out = []
    for action, base in pairs:
        diff = means[action] - means[base]
        low, high = percentile_interval(diff[None, 1:], level, axis=1)
        out.append(
            {
                "action": action,
                "baseline": base,
                "estimand": "accuracy",
                "value": float(diff[0]),
                "ci_low": float(low[0]),
                "ci_high": float(high[0]),
                "ci_level": level,
                "action_value": float(means[action][0]),
                "baseline_value": float(means[base][0]),
                "n_docs": len(doc_ids),
                "draws_dropped": int((~np.isfinite(diff[1:])).sum()),
            }
        )
    return pl.DataFrame(out)


def _timing_rows(
    estimands: pl.DataFrame, actions: Sequence[str], baseline: str | Mapping[str, str]
) -> pl.DataFrame:
    pooled = estimands.filter(pl.col("stratum") == "pooled")
    own = pooled.filter((pl.col("contrast") == "") & pl.col("estimand").is_in(_OWN))
    own_value = {(a, e): v for a, e, v in own.select("action", "estimand", "value").rows()}
    rows = []
    for action, base in contrast_pairs_of(actions, baseline):
        contrast = f"{action} - {base}"
        found = pooled.filter(pl.col("contrast") == contrast)
        if found.height == 0:
            raise ValueError(f"estimands: no contrast rows {contrast!r}")
        for r in found.filter(pl.col("estimand").is_in(list(CONTRAST_ESTIMANDS))).iter_rows(
            named=True
        ):
            rows.append(
                r
                | {
                    "action": action,
                    "baseline": base,
                    "action_value": own_value.get((action, r["estimand"])),
                    "baseline_value": own_value.get((base, r["estimand"])),
                }
            )
    return pl.DataFrame(rows)


def _sentence_number(x: float, digits: int, scale: float = 1.0) -> str:
    """``scale * x`` at ``digits`` decimals, never ``-0.0`` (an exact 0 is ``0``)."""
    v = scale * x
    text = f"{v:.{digits}f}"
    return "0" if v == 0 or float(text) == 0 else text


def _digits_for(value: float, digits: int, scale: float) -> int:
    """``digits``, or more where a nonzero ``value`` would round to 0 there (``0.00031``, not
    ``0.000``): a sentence shows its difference and interval at one precision."""
    d = digits
    while math.isfinite(value) and value != 0 and float(f"{scale * value:.{d}f}") == 0:
        d += 1
    return d


def _signed(x: float, digits: int, scale: float = 1.0) -> str:
    text = _sentence_number(x, digits, scale)
    return text if text.startswith("-") or text == "0" else f"+{text}"


def _directed(
    value: float,
    low: float,
    high: float,
    words: tuple[str, str, str],
    other: str,
    digits: int,
    scale: float = 1.0,
) -> str:
    """A difference in words (``words``: the comparative for a positive and a negative
    difference and the unit, e.g. ``("later", "earlier", "steps")``), against ``other``:

    - an interval that excludes 0: ``|value| unit word than other [interval]``, the interval
      turned to the sentence's direction ("7.0 steps earlier than snapkv [3.9, 12.2]");
    - an interval that includes 0: no direction is claimed: "not clearly later or earlier than
      snapkv: +0.8 steps [-0.7, 2.3], an interval that includes 0";
    - 0 with the interval [0, 0]: "the same as other (a difference of 0 in every bootstrap
      resample)";
    - an undefined interval: the direction, with "[interval undefined]".
    """
    more, less, unit = words
    unit_text = f" {unit}" if unit else ""
    digits = _digits_for(value, digits, scale)
    finite = math.isfinite(low) and math.isfinite(high)
    if value == 0 and finite and low == high == 0:
        return f"the same as {other} (a difference of 0 in every bootstrap resample)"
    if value == 0 and not finite:
        return f"the same as {other} [interval undefined]"
    if finite and covers_zero(low, high):
        lo, hi = _sentence_number(low, digits, scale), _sentence_number(high, digits, scale)
        return (
            f"not clearly {more} or {less} than {other}: {_signed(value, digits, scale)}"
            f"{unit_text} [{lo}, {hi}], an interval that includes 0"
        )
    if value < 0:
        value, low, high = -value, -high, -low
        word = less
    else:
        word = more
    interval = (
        f"[{_sentence_number(low, digits, scale)}, {_sentence_number(high, digits, scale)}]"
        if finite
        else "[interval undefined]"
    )
    return f"{_sentence_number(value, digits, scale)}{unit_text} {word} than {other} {interval}"


def _percent(x: float) -> str:
    """A share in percent without decimals, never ``-0%``."""
    text = f"{x:.0f}"
    return ("0" if float(text) == 0 else text) + "%"


def decomposition_sentence(shares: Sequence[float]) -> str:
    """The split of a gap into occurrence, exposure and rate (``shares`` in percent, summing to
    100): each share, and, when one lies outside [0, 100%], why (the terms have opposite
    signs, so they cancel in part and the others exceed the whole)."""
    o, e, r = (_percent(x) for x in shares)
    text = (
        f"Of that gap, occurrence (paths that diverge at all) accounts for {o}, exposure (how "
        f"long after divergence) {e} and rate (how often tokens differ after divergence) {r}."
    )
    if any(x < -0.5 or x > 100.5 for x in shares):
        text += (
            " Shares outside 0-100% mean the terms have opposite signs: one works against "
            "the gap, and the others add up to more than all of it."
        )
    return text


GREEDY_NOTE = (
    "Under greedy decoding every next-token law is a point mass, so every path's TV δ_t is 0 "
    "or 1 and equals the token mismatch: S_.99 and R then equal R_SMC, and each prompt has one "
    "path (K = 1)."
)
"""Stated once in a greedy summary: the identities that hold at temperature 0."""


def action_sentences(
    rows: pl.DataFrame, action: str, baseline: str, H: int, metric: str
) -> list[str]:
    """The sentences of ``summary.md`` on ``action`` against ``baseline`` (``rows``: their rows
    of the contrast table), in order: divergence within H, the entry time, R_SMC, its
    decomposition (where defined), task accuracy (where the table has it)."""
    by = {r["estimand"]: r for r in rows.iter_rows(named=True)}
    out = []
    p = by["div_prob"]
    other = f"{baseline} ({100 * p['baseline_value']:.0f}%)"
    more = _directed(
        p["value"], p["ci_low"], p["ci_high"], ("more", "fewer", "points"), other, 1, 100
    )
    out.append(
        f"{action} diverges from the full-cache model within H = {H} steps on "
        f"{100 * p['action_value']:.0f}% of paths, {more}."
    )
    e = by["mean_entry_time"]
    if math.isfinite(e["value"]):
        when = _directed(
            e["value"], e["ci_low"], e["ci_high"], ("later", "earlier", "steps"), baseline, 1
        )
        out.append(
            f"By the mean first divergence step τ of the paths that diverge, {action} diverges "
            f"{when}."
        )
    else:
        never = [a for a, v in ((action, p["action_value"]), (baseline, p["baseline_value"]))
                 if v == 0]  # fmt: skip
        who = " and ".join(never) if never else f"{action} or {baseline}"
        verb = "never diverge" if len(never) > 1 else "never diverges"
        out.append(f"The mean entry time is undefined: {who} {verb} within H = {H} steps here.")
    r = by["R_smc"]
    other = f"{baseline}'s ({r['baseline_value']:.3f})"
    gap = _directed(r["value"], r["ci_low"], r["ci_high"], ("higher", "lower", ""), other, 3)
    out.append(
        f"{action}'s R_SMC (the share of steps whose token differs from the full cache's) is "
        f"{r['action_value']:.3f}, {gap}."
    )
    shares = [100 * by[f"{t}_share"]["value"] for t in ("occurrence", "exposure", "rate")]
    if covers_zero(r["ci_low"], r["ci_high"]) and r["value"] != 0:
        out.append(
            "The gap's interval includes 0, so its split into occurrence, exposure and rate is "
            "not given (shares of a gap that may be 0 are unbounded)."
        )
    elif r["value"] != 0 and all(math.isfinite(s) for s in shares):
        out.append(decomposition_sentence(shares))
    a = by.get("accuracy")
    if a is not None and a["action_value"] == a["baseline_value"] == 0:
        out.append(
            f"No generation of {action} or {baseline} answers correctly ({metric}: 0% for "
            "both), so task accuracy does not tell them apart here."
        )
    elif a is not None:
        other = f"{baseline}'s ({100 * a['baseline_value']:.0f}%)"
        words = ("higher", "lower", "points")
        acc = _directed(a["value"], a["ci_low"], a["ci_high"], words, other, 1, 100)
        out.append(
            f"Task accuracy ({metric}) of {action}'s generations is "
            f"{100 * a['action_value']:.0f}%, {acc}."
        )
    return out


def contrast_sentences(
    table: pl.DataFrame,
    H: int,
    metric: str,
    temperature: float,
    *,
    model: str | None = None,
    unit: str = "prompts",
) -> str:
    """``summary.md``: plain sentences, one paragraph per action against the baseline (with
    ``model``, each title names it: one section per model of a pipeline study)."""
    if table.height == 0:
        return ""
    level = float(table["ci_level"][0])
    n_docs = int(table["n_docs"][0])
    decoding = "greedy decoding" if temperature == 0 else f"temperature {temperature:g}"
    named = f"{model}: " if model else ""
    lines = [
        f"# {named}against the baseline" if model else "# Against the baseline",
        "",
        f"{n_docs} {unit}, H = {H} generated tokens, {decoding}; brackets are paired "
        f"{100 * level:g}% document-bootstrap intervals of the difference."
        + (f" {GREEDY_NOTE}" if temperature == 0 else "")
        + (f" {note}" if (note := accuracy_resolution(table, n_docs)) else ""),
        "",
    ]
    for (action, baseline), rows in table.group_by(["action", "baseline"], maintain_order=True):
        out = action_sentences(rows, action, baseline, H, metric)
        lines += [f"## {named}{action} against {baseline}", "", " ".join(out), ""]
    return "\n".join(lines)


def contrast_table(
    estimands: pl.DataFrame,
    stats: pl.DataFrame,
    acc_stats: pl.DataFrame | None,
    actions: Sequence[str],
    baseline: str | Mapping[str, str],
    *,
    draws: int,
    seed: int,
    level: float,
) -> pl.DataFrame:
    """``contrasts.csv``'s table (:data:`CONTRAST_COLUMNS`, :data:`CONTRAST_ESTIMANDS` per
    action) of one model: ``estimands`` its rows, ``stats`` its document statistics (the
    estimands' documents), ``acc_stats`` its documents' accuracy (None: no Δ accuracy rows)."""
    timing = _timing_rows(estimands, actions, baseline)
    parts = [timing.select([c for c in CONTRAST_COLUMNS if c != "description"])]
    if acc_stats is not None:
        acc = accuracy_contrasts(
            stats, acc_stats, actions, baseline, draws=draws, seed=seed, level=level
        )
        parts.append(acc.select([c for c in CONTRAST_COLUMNS if c != "description"]))
    order = {e: i for i, e in enumerate(CONTRAST_ESTIMANDS)}
    rank = {a: i for i, a in enumerate(actions)}
    return (
        pl.concat(parts, how="vertical_relaxed")
        .with_columns(
            description=pl.col("estimand").replace_strict(CONTRAST_ESTIMANDS),
            _a=pl.col("action").replace_strict(rank),
            _e=pl.col("estimand").replace_strict(order),
        )
        .sort("_a", "_e")
        .select(CONTRAST_COLUMNS)
    )


def baseline_contrasts(
    estimands: pl.DataFrame,
    stats: pl.DataFrame,
    acc_stats: pl.DataFrame | None,
    actions: Sequence[str],
    baseline: str | Mapping[str, str],
    *,
    H: int,
    metric: str,
    draws: int,
    seed: int,
    level: float,
    temperature: float,
) -> tuple[pl.DataFrame, str]:
    """``contrasts.csv``'s table (:func:`contrast_table`) and ``summary.md``'s text
    (:func:`contrast_sentences`) of one model."""
    table = contrast_table(
        estimands, stats, acc_stats, actions, baseline, draws=draws, seed=seed, level=level
    )
    return table, contrast_sentences(table, H, metric, temperature)


def render_contrasts(table: pl.DataFrame) -> str:
    """``contrasts.md``: one row per action and estimand, the interval beside the value."""

    def fmt(x: float | None, estimand: str) -> str:
        if x is None or not math.isfinite(x):
            return "NA"
        return f"{x:.2f}" if estimand == "mean_entry_time" else f"{x:.4f}"

    model = "model" in table.columns
    lines = [
        ("| model " if model else "")
        + "| action | baseline | estimand | difference | interval | level | action | baseline "
        "| docs |",
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if model else ""),
    ]
    for r in table.iter_rows(named=True):
        e = r["estimand"]
        lines.append(
            (f"| {_md(r['model'])} " if model else "")
            + f"| {_md(r['action'])} | {_md(r['baseline'])} | {r['description']} | "
            f"{fmt(r['value'], e)} | [{fmt(r['ci_low'], e)}, {fmt(r['ci_high'], e)}] | "
            f"{r['ci_level']:.5g} | {fmt(r['action_value'], e)} | {fmt(r['baseline_value'], e)} | "
            f"{r['n_docs']} |"
        )
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def study_contrasts(
    estimands: pl.DataFrame,
    stats: Mapping[str, pl.DataFrame],
    acc_stats: Mapping[str, pl.DataFrame] | None,
    actions: Sequence[str],
    baseline: str | Mapping[str, str],
    *,
    cohort: str,
    H: int,
    draws: int,
    seed: int,
    level: float,
    temperature: float,
    labels: Mapping[str, str] | None = None,
) -> tuple[pl.DataFrame, str]:
    """A pipeline study's ``contrasts.csv`` (``model`` first, then :data:`CONTRAST_COLUMNS`)
    and ``summary.md`` (a section per model): every compared action minus ``baseline`` under
    each model (``baseline``: one action, or each action's own, as in
    :func:`contrast_pairs_of`), from the study's estimands table and, per model, its document
    statistics
    (``stats``, every cohort; the evaluation ``cohort``'s enter, as in the estimands table)
    and its documents' task accuracy (``acc_stats``; None: no Δ accuracy). The sentences name
    each action by its label (``labels``, default its name); the table keeps the names."""
    tables, texts = [], []
    for model, model_stats in stats.items():
        own = estimands.filter(pl.col("model") == model)
        if own.height == 0:
            raise ValueError(f"estimands: no rows of model {model!r}")
        docs = model_stats.filter(pl.col("cohort") == cohort)
        acc = None
        if acc_stats is not None:
            acc = acc_stats[model].filter(pl.col("cohort") == cohort)
        table = contrast_table(
            own, docs, acc, actions, baseline, draws=draws, seed=seed, level=level
        )
        tables.append(table.select(pl.lit(model).alias("model"), pl.all()))
        metric = "each source's metric"
        shown = labelled(table, labels)
        texts.append(
            contrast_sentences(shown, H, metric, temperature, model=model, unit="documents")
        )
    return pl.concat(tables), "\n".join(texts)


def labelled(table: pl.DataFrame, labels: Mapping[str, str] | None) -> pl.DataFrame:
    """A contrast table with its ``action`` and ``baseline`` shown as their labels (a study's
    ``config.actions.<name>.label``; an action without one keeps its name)."""
    if not labels:
        return table
    return table.with_columns(
        pl.col("action").replace(dict(labels)), pl.col("baseline").replace(dict(labels))
    )


def summary_paragraphs(summary: str) -> list[tuple[str, str]]:
    """``summary.md`` as (title, paragraph) pairs, in order: each heading's text with the
    paragraph that follows it (the report's landing page shows them)."""
    out: list[tuple[str, str]] = []
    title = ""
    for block in summary.split("\n\n"):
        block = block.strip()
        if block.startswith("#"):
            title = block.lstrip("#").strip()
        elif block:
            out.append((title, block))
            title = ""
    return out


def render_summary_html(summary: str, registration: str | None = None) -> str:
    """``summary.html``: the sentences of ``summary.md`` as a page (titles as headings)."""
    from kvdiverge.tables.render import html_document, html_text

    parts = []
    for block in summary.split("\n\n"):
        block = block.strip()
        level = len(block) - len(block.lstrip("#"))
        if level:
            tag = f"h{min(level, 3)}"
            parts.append(f"<{tag}>{html_text(block.lstrip('#').strip())}</{tag}>")
        elif block:
            parts.append(f"<p>{html_text(block)}</p>")
    if registration:
        parts.append(f"<p><em>{html_text(registration)}</em></p>")
    return html_document("each action against the baseline", "\n".join(parts))


def write_study_contrasts(
    table: pl.DataFrame,
    summary: str,
    csv: str | os.PathLike,
    md: str | os.PathLike,
    summary_md: str | os.PathLike,
    summary_html: str | os.PathLike,
    registration: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> None:
    """A study's ``contrasts.{csv,md}``, ``summary.md`` and ``summary.html`` (rule
    study_contrasts), each written atomically; ``registration``: the lock's registration line,
    under the Markdown and HTML renderings; ``labels``: the actions' labels, which the
    Markdown table shows (the CSV keeps the names)."""
    from kvdiverge.io import atomic_path, atomic_write_text

    with atomic_path(csv, suffix=".csv") as tmp:
        table.write_csv(tmp)
    note = f"\n{registration}\n" if registration else ""
    atomic_write_text(md, render_contrasts(labelled(table, labels)) + note)
    atomic_write_text(summary_md, summary.rstrip("\n") + "\n" + note)
    atomic_write_text(summary_html, render_summary_html(summary, registration))


def rst_text(text: str) -> str:
    """``text`` as reStructuredText inline text: its markup characters escaped."""
    return re.sub(r"([\\`*_|])", r"\\\1", text)


def render_summary_rst(table: pl.DataFrame, study: str, H: int, temperature: float) -> str:
    """``summary.rst``: the report's landing-page answer for ``study`` (workflow/report/
    workflow.rst includes it), short enough to read at a glance: per model, one line per
    action against the baseline with its entry-time and R_SMC sentences (``summary.md``'s
    headline; ``table``: :func:`study_contrasts`'s, with its ``model`` column)."""
    decoding = "greedy decoding" if temperature == 0 else f"temperature {temperature:g}"
    lines = []
    for (model,), rows in table.group_by(["model"], maintain_order=True):
        level, n_docs = float(rows["ci_level"][0]), int(rows["n_docs"][0])
        lines += [
            f"**{rst_text(study)}**, {rst_text(model)} ({n_docs} documents, H = {H}, {decoding}; "
            f"brackets: paired {100 * level:g}% intervals of the difference):",
            "",
        ]
        pairs = rows.group_by(["action", "baseline"], maintain_order=True)
        for (action, baseline), own in pairs:
            headline = action_sentences(own, action, baseline, H, "")[1:3]
            lines.append(f"- {rst_text(' '.join(headline))}")
        lines.append("")
    return "\n".join(lines)
