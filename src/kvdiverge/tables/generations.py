"""The generations of ``kvdiverge compare`` side by side: ``generations.parquet`` and
``generations.html``.

One row per path (action, prompt, replicate): the user's ``id`` and ``line`` of the prompts file,
the divergence step τ (the first step whose tokens differ; null when the path never diverges
within H), its timing class, both texts' scores, the full-cache text X and the evicted text Y,
their shared prefix (the text of the τ − 1 tokens they share) and each one's continuation from
τ on, and δ_t (the rollout TV of each step). The HTML page shows, per prompt and action, one
path (the first replicate that diverged, else replicate 0) as the shared prefix followed by the
two continuations, the divergence token marked, each generated token of the prefix shaded by
δ_t (its value on hover), and the τ of every replicate.
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl

__all__ = ["generations_table", "render_generations_html", "token_pieces", "write_generations"]


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
    keys: pl.DataFrame,
    tokenizer: Any,
    depth: int,
) -> pl.DataFrame:
    """The rows of ``generations.parquet`` (module docstring). ``documents`` carries ``metric``
    (:func:`kvdiverge.analysis.accuracy.document_metrics`); ``keys`` maps ``doc_id`` to the
    user's ``user_id`` and ``line``."""
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
    table = pl.concat(parts).join(keys, on="doc_id", how="left")
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


def render_generations_html(
    table: pl.DataFrame, documents: pl.DataFrame, tokenizer: Any, title: str = "Generations"
) -> str:
    """``generations.html`` (module docstring)."""
    prompts = dict(documents.select("doc_id", "prompt").rows())
    actions = table["action"].unique(maintain_order=True).to_list()
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        '<p class="legend"><span><b>X</b>: full cache</span><span><b>Y</b>: the action\'s '
        "evicted cache</span><span>bold: the divergence token (step τ)</span><span>shading: "
        "δ_t, the total variation between the two kernels at step t (hover a token)</span></p>",
    ]
    for doc_id in table["doc_id"].unique(maintain_order=True).to_list():
        rows = table.filter(pl.col("doc_id") == doc_id)
        first = rows.row(0, named=True)
        who = f"id {first['user_id']!r}, " if first["user_id"] is not None else ""
        out.append(f"<h2>Prompt {html.escape(who + str(first['line']))}</h2>")
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
            out.append(
                f'<tr><th>{html.escape(action)}</th><td><div class="meta">replicate '
                f"{shown['replicate']} · {head} · τ of every replicate: {taus} · accuracy X "
                f"{shown['acc_x']:.2f}, Y {shown['acc_y']:.2f}</div>"
                f'<div class="gen x"><b>X</b> {prefix}'
                f"{x_rest}</div>"
                f'<div class="gen y"><b>Y</b> {prefix}'
                f"{y_rest}</div></td></tr>"
            )
        out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


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
