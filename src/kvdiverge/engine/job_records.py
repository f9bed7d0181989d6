"""What a rollout job's trajectory files record per action besides their rows: the summed
timing of its documents and the bytes the action's cache held in each of them
(:func:`kvdiverge.engine.rollout_job.run_stratum_rollout_job`).

A job keeps, per finished document, ``{action: {timing keys..., "cache_bytes": {start, end}}}``
in its scratch area (:func:`with_cache_bytes`); the files' ``timing`` metadata sums the timing
keys over the documents (:func:`sum_timing`) and their ``cache_bytes`` metadata holds each
document's per-layer bytes at the start and the end of the horizon (:func:`cache_bytes_record`,
``docs/engine.md``, "Cache bytes"); ``libraries`` the versions of :data:`LIBRARIES`
(:func:`library_versions`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "LIBRARIES",
    "cache_bytes_record",
    "library_versions",
    "sum_timing",
    "with_cache_bytes",
]

LIBRARIES = ("torch", "transformers", "kvpress")


def library_versions() -> dict[str, str | None]:
    """The installed versions of :data:`LIBRARIES` (``None`` for one not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def sum_timing(
    parts: Iterable[Mapping[str, Mapping[str, Any]]], keys: Sequence[str]
) -> dict[str, dict]:
    """Per action, the sums of the timing ``keys`` over the documents' ``parts`` (other keys,
    such as ``cache_bytes``, are left out)."""
    total: dict[str, dict[str, float]] = {}
    for part in parts:
        for name, values in part.items():
            sums = total.setdefault(name, dict.fromkeys(keys, 0))
            for key in keys:
                sums[key] += values.get(key, 0)
    return total


def with_cache_bytes(timing: dict[str, dict[str, Any]], results: Mapping[str, Any]) -> dict:
    """One document's scratch record: its ``timing`` per action, each with the action's
    ``cache_bytes`` (:attr:`kvdiverge.engine.ActionPaths.cache_bytes`) beside it."""
    for name, result in results.items():
        timing.setdefault(name, {})["cache_bytes"] = result.cache_bytes
    return timing


def cache_bytes_record(
    parts: Mapping[str, Mapping[str, Mapping[str, Any]]], order: Sequence[str], name: str
) -> dict[str, Any]:
    """The ``cache_bytes`` metadata of action ``name``'s file: ``unit`` (bytes), ``per``
    (layer), and per document (in ``order``, those that ran the action) its per-layer bytes at
    the start (``start``: the prompt part) and the end (``end``: at step H) of the horizon."""
    documents = {
        doc_id: dict(parts[doc_id][name]["cache_bytes"])
        for doc_id in order
        if name in parts[doc_id] and parts[doc_id][name].get("cache_bytes") is not None
    }
    return {"unit": "bytes", "per": "layer", "documents": documents}
