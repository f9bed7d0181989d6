"""Generations side by side: ``kvdiverge compare``'s ``generations.parquet`` and
``generations.html``, and the pipeline's page of each study's sampled generations.

One row per path (action, prompt, replicate): the user's ``id`` and ``line`` of the prompts file,
the divergence step τ (the first step whose tokens differ; null when the path never diverges
within H), its timing class, both texts' scores, the full-cache text X and the evicted text Y,
their shared prefix (the text of the τ − 1 tokens they share) and each one's continuation from
τ on, and δ_t (the rollout TV of each step). The HTML page shows, per prompt and action, one
path (the first replicate that diverged, else replicate 0) as the shared prefix followed by the
two continuations, the divergence token marked, each generated token of the prefix shaded by
δ_t (its value on hover), and the τ of every replicate.

The pipeline's report has a page of the same kind per study (rule ``study_generations``):
:func:`shown_timing` and :func:`sample_documents` draw a few evaluation documents per model,
action and stratum, deterministically and mixing early, late and never diverged paths, and
:func:`render_study_generations_html` shows them per model with the same sections
(:func:`generations_sections`).
"""

from __future__ import annotations

import html
import os
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl

__all__ = [
    "generations_sections",
    "generations_table",
    "render_generations_html",
    "render_study_generations_html",
    "sample_documents",
    "sampled_generations",
    "shown_timing",
    "token_pieces",
    "write_generations",
]


def token_pieces(tokenizer: Any, tokens: Sequence[int]) -> list[str]:
    """The text each token adds: the differences of the decoded prefixes (so that the pieces join
    to the decoded whole, spaces included)."""
    pieces, previous = [], ""
    for k in range(1, len(tokens) + 1):
        text = tokenizer.decode([int(t) for t in tokens[:k]], skip_special_tokens=True)
        pieces.append(text[len(previous) :] if text.startswith(previous) else text)
        previous = text
    return pieces


def _ended(eos: np.ndarray) -> int:
    return int(eos.argmax()) if eos.any() else len(eos)


def generations_table(
    frames: Mapping[str, pl.DataFrame],
    actions: Sequence[str],
    documents: pl.DataFrame,
    keys: pl.DataFrame | None,
    tokenizer: Any,
    depth: int,
) -> pl.DataFrame:
    """The rows of ``generations.parquet`` (module docstring). ``documents`` carries ``metric``
    (:func:`kvdiverge.analysis.accuracy.document_metrics`); ``keys`` maps ``doc_id`` to the
    user's ``user_id`` and ``line`` (None: both null, as for the pipeline's documents, which
    their ``doc_id`` names)."""
    from kvdiverge.analysis.accuracy import TIMING_CLASSES, path_scores

    parts = []
    for action in actions:
        frame = frames[action].sort("doc_id", "replicate", "t")
        scores = path_scores(frame, documents, tokenizer, depth)
        h = int(frame["t"].max())
        n = frame.height // h

        def grid(name: str, frame: pl.DataFrame = frame, n: int = n, h: int = h) -> np.ndarray:
            return frame[name].to_numpy().reshape(n, h)

        x_tok, y_tok, mism = grid("x_token"), grid("y_token"), grid("mismatch")
        x_eos, y_eos, delta = grid("x_eos"), grid("y_eos"), grid("tv_rollout")
        rows: dict[str, list] = {"tau": [], "prefix": [], "x_continuation": []}
        rows |= {"y_continuation": [], "delta": []}
        for i in range(n):
            tau = int(mism[i].argmax()) + 1 if mism[i].any() else None
            shared = (tau - 1) if tau is not None else h
            x_end, y_end = _ended(x_eos[i]), _ended(y_eos[i])
            prefix_tokens = x_tok[i][: min(shared, x_end)]
            pieces = token_pieces(tokenizer, x_tok[i][:x_end])
            prefix = "".join(pieces[: len(prefix_tokens)])
            x_text = "".join(pieces)
            y_text = tokenizer.decode([int(t) for t in y_tok[i][:y_end]], skip_special_tokens=True)
            rows["tau"].append(tau)
            rows["prefix"].append(prefix)
            rows["x_continuation"].append(x_text[len(prefix) :] if tau is not None else "")
            rows["y_continuation"].append(
                (y_text[len(prefix) :] if y_text.startswith(prefix) else y_text)
                if tau is not None
                else ""
            )
            rows["delta"].append(delta[i].astype(np.float64).tolist())
        parts.append(
            scores.with_columns(
                action=pl.lit(action),
                tau=pl.Series(rows["tau"], dtype=pl.Int32),
                prefix=pl.Series(rows["prefix"], dtype=pl.String),
                x_continuation=pl.Series(rows["x_continuation"], dtype=pl.String),
                y_continuation=pl.Series(rows["y_continuation"], dtype=pl.String),
                delta=pl.Series(rows["delta"], dtype=pl.List(pl.Float64)),
                x_tokens=pl.Series([r.tolist() for r in x_tok], dtype=pl.List(pl.Int32)),
                y_tokens=pl.Series([r.tolist() for r in y_tok], dtype=pl.List(pl.Int32)),
            )
        )
    table = pl.concat(parts)
    if keys is None:
        table = table.with_columns(user_id=pl.lit(None, pl.String), line=pl.lit(None, pl.String))
    else:
        table = table.join(keys, on="doc_id", how="left")
    return table.select(
        "action",
        "doc_id",
        "user_id",
        "line",
        "replicate",
        "tau",
        pl.col("timing").replace_strict(dict(enumerate(TIMING_CLASSES)), return_dtype=pl.String),
        "acc_x",
        "acc_y",
        "x_text",
        "y_text",
        "prefix",
        "x_continuation",
        "y_continuation",
        "delta",
        "x_tokens",
        "y_tokens",
    )


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 70em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
.prompt { color: #555; white-space: pre-wrap; font-size: .85em; max-height: 6em; overflow: auto;
  background: #f6f6f6; padding: .4em .6em; border-radius: 4px; }
table { border-collapse: collapse; width: 100%; margin-top: .5em; }
td, th { border-top: 1px solid #ddd; padding: .35em .5em; vertical-align: top; text-align: left; }
th { font-weight: 600; white-space: nowrap; width: 9em; }
.gen { font-family: ui-monospace, monospace; white-space: pre-wrap; }
.tok { border-bottom: 2px solid transparent; }
.div { font-weight: 700; border-radius: 3px; padding: 0 1px; }
.x .div { background: #cfe3f7; outline: 1px solid #0072B2; }
.y .div { background: #fbd9c3; outline: 1px solid #D55E00; }
.rest { text-decoration: underline dotted #999; }
.meta { color: #666; font-size: .85em; }
.legend span { margin-right: 1.5em; }
"""


def _shade(value: float) -> str:
    alpha = min(max(float(value), 0.0), 1.0)
    return f"background: rgba(213, 94, 0, {0.6 * alpha:.3f})"


def _prefix_html(pieces: Sequence[str], delta: Sequence[float]) -> str:
    spans = []
    for piece, d in zip(pieces, delta, strict=False):
        attrs = f'class="tok" style="{_shade(d)}" title="δ_t = {d:.3f}"'
        spans.append(f"<span {attrs}>{html.escape(piece)}</span>")
    return "".join(spans)


def _continuation_html(pieces: Sequence[str]) -> str:
    """A continuation from τ on, token by token: its first token (the divergence token)
    marked."""
    if not pieces:
        return ""
    rest = html.escape("".join(pieces[1:]))
    return f'<span class="div">{html.escape(pieces[0])}</span><span class="rest">{rest}</span>'


_LEGEND = (
    '<p class="legend"><span><b>X</b>: full cache</span><span><b>Y</b>: the action\'s '
    "evicted cache</span><span>bold: the divergence token (step τ)</span><span>shading: "
    "δ_t, the total variation between the two kernels at step t (hover a token)</span></p>"
)


def _page(title: str, body: Sequence[str]) -> str:
    """A self-contained page: ``title`` as its title and first heading, then ``body``."""
    head = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    return "\n".join([*head, *body, "</body></html>"]) + "\n"


def _user_heading(row: Mapping[str, Any]) -> str:
    """``Prompt id 'fox', line 1``: the user's id (where the prompts file gives one) and line."""
    who = f"id {row['user_id']!r}, " if row["user_id"] is not None else ""
    return f"Prompt {who}{row['line']}"


def generations_sections(
    table: pl.DataFrame,
    prompts: Mapping[str, str],
    tokenizer: Any,
    headings: Mapping[str, str] | None = None,
    level: int = 2,
    labels: Mapping[str, str] | None = None,
) -> list[str]:
    """The HTML of every prompt of a :func:`generations_table` table, in its order: a heading
    (``headings[doc_id]``, else the user's id and line) at ``<h{level}>``, the prompt
    (``prompts[doc_id]``), and per action one path (the first replicate that diverged, else
    replicate 0): the shared prefix shaded by δ_t, then X's and Y's continuations from τ on, the
    divergence token (step τ, where the path diverged) marked. Each action's row is headed by
    ``labels[action]`` where given (a display label), else its name."""
    actions = table["action"].unique(maintain_order=True).to_list()
    out = []
    for doc_id in table["doc_id"].unique(maintain_order=True).to_list():
        rows = table.filter(pl.col("doc_id") == doc_id)
        first = rows.row(0, named=True)
        heading = headings[doc_id] if headings is not None else _user_heading(first)
        out.append(f"<h{level}>{html.escape(heading)}</h{level}>")
        out.append(f'<div class="prompt">{html.escape(prompts.get(doc_id, ""))}</div>')
        out.append("<table>")
        for action in actions:
            paths = rows.filter(pl.col("action") == action).sort("replicate")
            if paths.height == 0:
                continue
            diverged = paths.filter(pl.col("tau").is_not_null())
            shown = (diverged if diverged.height else paths).row(0, named=True)
            taus = ", ".join("never" if t is None else str(t) for t in paths["tau"].to_list())
            tau = shown["tau"]
            x_pieces = token_pieces(tokenizer, shown["x_tokens"])
            y_pieces = token_pieces(tokenizer, shown["y_tokens"])
            n_prefix = (tau - 1) if tau is not None else len(x_pieces)
            prefix = _prefix_html(x_pieces[:n_prefix], shown["delta"])
            x_rest = _continuation_html(x_pieces[n_prefix:])
            y_rest = _continuation_html(y_pieces[n_prefix:])
            head = f"τ = {tau}" if tau is not None else f"never diverged within H = {len(x_pieces)}"
            every = f" · τ of every replicate: {taus}" if paths.height > 1 else ""  # one: shown
            out.append(
                f"<tr><th>{html.escape((labels or {}).get(action, action))}</th>"
                f'<td><div class="meta">replicate '
                f"{shown['replicate']} · {head}{every} · accuracy X "
                f"{shown['acc_x']:.2f}, Y {shown['acc_y']:.2f}</div>"
                f'<div class="gen x"><b>X</b> {prefix}'
                f"{x_rest}</div>"
                f'<div class="gen y"><b>Y</b> {prefix}'
                f"{y_rest}</div></td></tr>"
            )
        out.append("</table>")
    return out


def render_generations_html(
    table: pl.DataFrame, documents: pl.DataFrame, tokenizer: Any, title: str = "Generations"
) -> str:
    """``generations.html`` (module docstring)."""
    prompts = dict(documents.select("doc_id", "prompt").rows())
    return _page(title, [_LEGEND, *generations_sections(table, prompts, tokenizer)])


def shown_timing(trajectories: pl.DataFrame, depth: int) -> pl.DataFrame:
    """Per document of a trajectory table, the divergence timing of the path the page shows
    (the first replicate that diverged, else replicate 0): ``doc_id``, ``tau`` (null when no
    replicate diverged within H) and ``timing`` (``early`` τ ≤ ``depth``, ``late`` τ > ``depth``,
    ``never``; :data:`kvdiverge.analysis.accuracy.TIMING_CLASSES`)."""
    from kvdiverge.analysis.accuracy import TIMING_CLASSES

    early, late, never = TIMING_CLASSES
    first = (
        trajectories.filter(pl.col("mismatch"))
        .group_by("doc_id", "replicate")
        .agg(pl.col("t").min().alias("tau"))
        .sort("doc_id", "replicate")
        .group_by("doc_id", maintain_order=True)
        .agg(pl.col("tau").first())
    )
    docs = trajectories.select("doc_id").unique().sort("doc_id")
    return (
        docs.join(first, on="doc_id", how="left")
        .with_columns(pl.col("tau").cast(pl.Int32))
        .with_columns(
            timing=pl.when(pl.col("tau").is_null())
            .then(pl.lit(never))
            .when(pl.col("tau") <= depth)
            .then(pl.lit(early))
            .otherwise(pl.lit(late))
        )
    )


def sample_documents(
    timing: pl.DataFrame, per_stratum: int, seed: int, key: str = ""
) -> dict[str, list[str]]:
    """A deterministic sample of documents per stratum, mixing divergence timings.

    ``timing`` holds ``doc_id``, ``stratum`` and ``timing`` (:func:`shown_timing`). Per stratum
    (in sorted order), with the generator ``numpy.random.default_rng([seed, crc32(key/stratum)])``,
    one document of each timing class present (early, late, never, in that order) is drawn
    uniformly, then the rest of the ``per_stratum`` places from the documents left; the chosen
    ones are returned in the order early, late, never, then by ``doc_id``. The same inputs draw
    the same sample."""
    from kvdiverge.analysis.accuracy import TIMING_CLASSES

    if per_stratum < 1:
        raise ValueError(f"per_stratum: expected an integer >= 1, got {per_stratum!r}")
    order = {c: k for k, c in enumerate(TIMING_CLASSES)}
    out: dict[str, list[str]] = {}
    for stratum in sorted(set(timing["stratum"].to_list())):
        rows = timing.filter(pl.col("stratum") == stratum).sort("doc_id")
        docs = rows["doc_id"].to_list()
        cls = dict(zip(docs, rows["timing"].to_list(), strict=True))
        rng = np.random.default_rng([seed, zlib.crc32(f"{key}/{stratum}".encode())])
        chosen: list[str] = []
        for c in TIMING_CLASSES:
            pool = [d for d in docs if cls[d] == c]
            if pool and len(chosen) < per_stratum:
                chosen.append(pool[int(rng.integers(len(pool)))])
        rest = [d for d in docs if d not in chosen]
        extra = rng.permutation(len(rest))[: max(per_stratum - len(chosen), 0)]
        chosen += [rest[int(i)] for i in extra]
        out[stratum] = sorted(chosen, key=lambda d: (order[cls[d]], d))
    return out


def sampled_generations(
    frames: Mapping[str, pl.DataFrame],
    documents: pl.DataFrame,
    tokenizer: Any,
    depth: int,
    per_stratum: int,
    seed: int,
    key: str = "",
) -> pl.DataFrame:
    """The :func:`generations_table` rows (``keys`` None) of a sample of documents: per action
    of ``frames`` (action → its trajectory table) and stratum, :func:`sample_documents` of
    :func:`shown_timing` with ``key/action``; every sampled document is shown under every
    action. ``documents`` holds ``doc_id``, ``stratum``, ``answers`` and ``metric``."""
    strata = documents.select("doc_id", "stratum")
    chosen: set[str] = set()
    for action, frame in frames.items():
        timing = shown_timing(frame, depth).join(strata, on="doc_id", how="left")
        if timing["stratum"].null_count():
            missing = timing.filter(pl.col("stratum").is_null())["doc_id"][0]
            raise ValueError(f"{action}: doc_id {missing!r} is not in the documents table")
        for ids in sample_documents(timing, per_stratum, seed, f"{key}/{action}").values():
            chosen.update(ids)
    keep = sorted(chosen)
    sub = {a: f.filter(pl.col("doc_id").is_in(keep)) for a, f in frames.items()}
    return generations_table(sub, list(frames), documents, None, tokenizer, depth)


def render_study_generations_html(
    sections: Sequence[tuple[str, pl.DataFrame, pl.DataFrame, Any]],
    title: str,
    intro: str = "",
    labels: Mapping[str, str] | None = None,
) -> str:
    """The pipeline's page of a study's sampled generations: per model (``sections``: model
    name, its :func:`generations_table` rows, its documents with ``doc_id``, ``prompt``,
    ``stratum``, ``task``, and its tokenizer) a heading, then each sampled document under its
    ``doc_id``, stratum and task, shown as :func:`generations_sections` shows compare's
    prompts. ``intro`` is a paragraph of plain text after the legend; ``labels``: the actions'
    display labels by name (default: their names)."""
    body = [_LEGEND]
    if intro:
        body.append(f"<p>{html.escape(intro)}</p>")
    for model, table, documents, tokenizer in sections:
        body.append(f"<h2>Model {html.escape(model)}</h2>")
        docs = documents.filter(pl.col("doc_id").is_in(table["doc_id"].unique().to_list()))
        prompts = dict(docs.select("doc_id", "prompt").rows())
        headings = {
            d: f"Document {d} ({s}, task {t})"
            for d, s, t in docs.select("doc_id", "stratum", "task").rows()
        }
        body += generations_sections(table, prompts, tokenizer, headings, 3, labels)
    return _page(title, body)


def write_generations(
    table: pl.DataFrame,
    parquet: str | os.PathLike,
    page: str | os.PathLike,
    documents: pl.DataFrame,
    tokenizer: Any,
) -> None:
    """Write ``generations.parquet`` and ``generations.html``, atomically."""
    from kvdiverge.io import atomic_path, atomic_write_text

    with atomic_path(parquet, suffix=".parquet") as tmp:
        table.write_parquet(tmp)
    atomic_write_text(page, render_generations_html(table, documents, tokenizer))
