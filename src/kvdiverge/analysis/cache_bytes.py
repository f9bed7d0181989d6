"""Each action's cache bytes beside its budget, from its trajectory files' ``cache_bytes``
metadata (``docs/engine.md``, "Cache bytes"; ``docs/compression.md``, "Bytes").

Per action: its budget (a fraction or a token count, ``<b> bits`` for a quantized cache, ``all``
for the control), the documents it ran, the mean over documents of its cache's bytes over all
layers at the start of the horizon (the prompt part) and at its end (step H), and the mean over
documents of each as a share of the control's bytes on the same document (documents weigh
equally, as in every estimand). A document the control did not run is refused in one line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import polars as pl

__all__ = [
    "CACHE_BYTES_COLUMNS",
    "budget_label",
    "cache_bytes_markdown",
    "cache_bytes_table",
    "full_cache_bytes",
    "read_cache_bytes",
]

CACHE_BYTES_COLUMNS = (
    "action",
    "budget",
    "n_docs",
    "start_bytes",
    "end_bytes",
    "start_share",
    "end_share",
)


def budget_label(action: Mapping[str, Any]) -> str:
    """An action's budget as the table shows it: ``0.5``, ``512``, ``4 bits``, ``4 bits
    (quanto)`` (transformers' QuantizedCache), ``all``; for compression during decoding its
    sizes (``4 + 188 entries``, ``192 entries every 8 steps``)."""
    if action.get("selector") == "quantize":
        return f"{action.get('bits')} bits"
    if action.get("selector") == "quantized-cache":  # transformers' QuantizedCache
        return f"{action.get('nbits')} bits ({action.get('backend')})"
    if action.get("selector") == "streaming":  # compression during decoding: its sizes
        return f"{action.get('sinks')} + {action.get('window')} entries"
    press = action.get("press_kwargs")
    decoding = isinstance(press, Mapping) and "target_size" in press  # kvpress's DecodingPress
    if action.get("selector") == "kvpress" and decoding:
        return f"{press['target_size']} entries every {press.get('compression_interval')} steps"
    if action.get("budget") is None:
        return "all"
    return repr(action["budget"])


def read_cache_bytes(paths: Sequence[str | os.PathLike]) -> tuple[dict, dict[str, dict]]:
    """The action (its metadata ``action``) and ``{doc_id: {start, end}}`` of one action's
    trajectory files; one line naming the file that lacks ``cache_bytes``."""
    from kvdiverge.io.trajectories import TrajectoryFormatError, read_trajectory_metadata

    action: dict = {}
    documents: dict[str, dict] = {}
    for path in paths:
        meta = read_trajectory_metadata(path)
        record = meta.get("cache_bytes")
        if not isinstance(record, Mapping) or not isinstance(record.get("documents"), Mapping):
            raise TrajectoryFormatError(
                f"{path}: no cache_bytes metadata; expected a file written by a rollout job "
                "that records its cache bytes (rerun the job)"
            )
        action = dict(meta["action"])
        documents.update(record["documents"])
    return action, documents


def full_cache_bytes(
    n: int, H: int, layers: int, n_kv: int, head_dim: int, itemsize: int
) -> dict[str, list[int]]:
    """The full cache's bytes per layer for an n-token prompt: n entries × 2 × ``n_kv`` ×
    ``head_dim`` × ``itemsize`` at the start, plus the H − 1 generated entries at the end."""
    entry = 2 * n_kv * head_dim * itemsize
    return {"start": [n * entry] * layers, "end": [(n + max(H - 1, 0)) * entry] * layers}


def cache_bytes_table(
    actions: Mapping[str, tuple[Mapping[str, Any], Mapping[str, Mapping[str, Sequence[int]]]]],
    control: str | Mapping[str, Mapping[str, Sequence[int]]],
) -> pl.DataFrame:
    """:data:`CACHE_BYTES_COLUMNS` per action (module docstring) from ``actions``: name →
    (the action's metadata, ``{doc_id: {start: [per layer], end: [per layer]}}``), in order;
    ``control`` names the action whose bytes the shares divide by, or gives the full cache's
    bytes by document itself (:func:`full_cache_bytes`)."""
    if isinstance(control, str) and control not in actions:
        raise ValueError(f"control: {control!r} is not among the actions {', '.join(actions)}")
    base = actions[control][1] if isinstance(control, str) else control
    named = repr(control) if isinstance(control, str) else "the full cache"
    rows = []
    for name, (action, documents) in actions.items():
        if not documents:
            raise ValueError(f"action {name!r}: no documents with cache bytes")
        missing = [d for d in documents if d not in base]
        if missing:
            raise ValueError(
                f"action {name!r}: document {missing[0]} has no bytes of the control {named}"
            )
        start = [sum(documents[d]["start"]) for d in documents]
        end = [sum(documents[d]["end"]) for d in documents]
        start_share = [s / sum(base[d]["start"]) for s, d in zip(start, documents, strict=True)]
        end_share = [e / sum(base[d]["end"]) for e, d in zip(end, documents, strict=True)]
        k = len(documents)
        rows.append(
            {
                "action": name,
                "budget": budget_label(action),
                "n_docs": k,
                "start_bytes": sum(start) / k,
                "end_bytes": sum(end) / k,
                "start_share": sum(start_share) / k,
                "end_share": sum(end_share) / k,
            }
        )
    return pl.DataFrame(rows, schema=list(CACHE_BYTES_COLUMNS), orient="row")


def cache_bytes_markdown(table: pl.DataFrame) -> str:
    """The table as Markdown: MiB (2^20 bytes) and shares in percent of the full cache."""
    lines = [
        "| action | budget | documents | MiB at step 1 | MiB at step H | share of full at "
        "step 1, % | share of full at step H, % |",
        "|:---|:---|---:|---:|---:|---:|---:|",
    ]
    for r in table.iter_rows(named=True):
        lines.append(
            f"| {r['action']} | {r['budget']} | {r['n_docs']} | {r['start_bytes'] / 2**20:.2f} "
            f"| {r['end_bytes'] / 2**20:.2f} | {100 * r['start_share']:.1f} "
            f"| {100 * r['end_share']:.1f} |"
        )
    return "\n".join(lines) + "\n"
