"""The metrics of one ``kvdiverge compare`` folder: its ``metrics.json`` record
(:mod:`kvdiverge.tables.metrics`), the documents' digest two runs on the same prompts share,
and the accuracy metric as the sentences name it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import polars as pl

from kvdiverge.compare.actions import LabelledAction

__all__ = ["documents_digest", "folder_metrics", "metric_name"]


def metric_name(documents: pl.DataFrame) -> str:
    """The accuracy metric as sentences name it: one metric, or "each task's metric (...)"."""
    metrics = sorted(set(documents["metric"].to_list()))
    return metrics[0] if len(metrics) == 1 else f"each task's metric ({', '.join(metrics)})"


def documents_digest(documents: pl.DataFrame) -> str:
    """SHA-256 of the prompts and answers in document order (canonical JSON): two runs on the
    same prompts share it, wherever their files lie."""
    import hashlib
    import json

    rows = documents.select("doc_id", "prompt", "answers").to_dicts()
    text = json.dumps(rows, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def folder_metrics(
    name: str,
    model: str,
    labelled: Sequence[LabelledAction],
    pairs: dict[str, str],
    estimands: pl.DataFrame,
    contrasts: pl.DataFrame | None,
    accuracy: pl.DataFrame,
    documents: pl.DataFrame,
    *,
    metadata: dict[str, Any],
    **settings: Any,
) -> dict[str, Any]:
    """The folder's ``metrics.json`` record (:mod:`kvdiverge.tables.metrics`)."""
    from kvdiverge import __version__
    from kvdiverge.tables.metrics import metrics_record

    own = settings | {
        "coupling": metadata["coupling"],
        "documents": documents_digest(documents),
        "n_documents": documents.height,
        "dtype": metadata["dtype"],
        "device": metadata["device"],
        "model_path": metadata["model"]["path"],
    }
    return metrics_record(
        kind="compare",
        name=name,
        models=[model],
        actions={a.label: a.action.as_dict() | {"spec": a.spec} for a in labelled},
        baseline=pairs or None,
        settings=own,
        estimands=estimands,
        contrasts=contrasts,
        accuracy=accuracy,
        package_version=__version__,
    )
