"""kvpress's ``DecodingPress`` as a compression during decoding (``eviction.decoding``).

kvpress 0.5.5's DecodingPress leaves the prefill's cache whole and, in a forward hook after each
decoding step's attention, counts the steps of each layer; once ``compression_interval`` steps
have run since the layer's last compression (or at every step when ``target_size`` <= 1), it
compresses that layer's whole cache — prompt and generated entries, in the order the cache holds
them — to ``target_size`` entries per KV head: its base press's ``score`` over the cache, at the
ratio its ``_find_target_compression_ratio`` gives, and ``topk`` of kvpress's own kept count
(``compute_n_kept``), which also sets the new cache's order (by score, not position). Nothing is
compressed while the cache holds at most ``target_size`` entries.

The bridge runs exactly that, per row, with the engine's schedule (interval
``compression_interval``, or 1 when ``target_size`` <= 1) and the row's cache in its own order:
:func:`decoding_kept` calls the base press's own ``score`` and the same ``topk``. The base press
must score from the keys and values alone (:data:`KEY_SCORERS`): the engine passes no hidden
states, queries or attention weights of the rows. ``tests/eviction/test_kvpress_decoding.py``
runs kvpress's own hooks on a tiny model step by step against it.
"""

from __future__ import annotations

import typing
from typing import Any

from kvdiverge.eviction.budgets import ActionError

if typing.TYPE_CHECKING:  # torch is imported where it runs: parsing a config does not load it
    import torch

__all__ = ["KEY_SCORERS", "check_base_press", "decoding_kept", "decoding_schedule"]

KEY_SCORERS = ("KeyDiffPress", "KnormPress", "StreamingLLMPress")
"""Base presses of a bridged DecodingPress: their ``score`` reads only the keys (and values)."""


def check_base_press(press: Any, where: str) -> None:
    """A DecodingPress's base press must be one of :data:`KEY_SCORERS` (one line otherwise)."""
    base = type(getattr(press, "base_press", None))
    if base.__name__ not in KEY_SCORERS or not base.__module__.startswith("kvpress"):
        raise ActionError(
            f"{where}.press_kwargs.base_press: {base.__name__} is refused under DecodingPress: "
            "the decoding bridge passes each row's keys and values only, no hidden states, "
            f"queries or attention weights; expected one of {', '.join(KEY_SCORERS)}"
        )


def decoding_schedule(press: Any) -> tuple[int, int]:
    """(interval, max_entries) of a DecodingPress: every ``compression_interval`` steps, every
    step when ``target_size`` <= 1 (kvpress's ``q_len >= target_size`` with one query)."""
    return (1 if press.target_size <= 1 else int(press.compression_interval)), 0


def decoding_kept(press: Any, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Indices (H_kv, m) of the entries kvpress's DecodingPress keeps of one row's layer cache
    ``keys``/``values`` (H_kv, L, d) in its order, in the order its compressed cache holds them
    (all of them, in order, when L <= ``target_size``)."""
    import torch
    from kvpress.utils import compute_n_kept

    length = keys.shape[1]
    target = press._resolve_target_size({})
    ratio = press._find_target_compression_ratio(length, target)
    if ratio == 0:  # ScorerPress.compress returns the cache unchanged
        return torch.arange(length, device=keys.device).expand(keys.shape[0], -1)
    base = press.base_press
    before = base.compression_ratio
    base.compression_ratio = ratio
    try:
        scores = base.score(None, None, keys[None], values[None], None, {})
    finally:
        base.compression_ratio = before
    return scores[0].topk(compute_n_kept(length, ratio), dim=-1).indices
