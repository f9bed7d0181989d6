"""The status of every press class kvpress exports (``docs/compression.md``, "kvpress presses"):
bridged (run by :mod:`kvdiverge.eviction.kvpress_bridge`, and how) or refused (and why), as
the bridge itself decides it for the installed kvpress (:func:`press_status`).

The presses are enumerated from the installed package (:func:`exported_presses`: every class
of ``kvpress.__all__`` that subclasses ``BasePress``, the two base classes ``BasePress`` and
``ScorerPress`` aside), so a kvpress release that adds or drops a press changes the list, and
``tests/eviction/test_kvpress_status.py`` holds the documented table to it.
"""

from __future__ import annotations

from kvdiverge.eviction.budgets import ActionError

__all__ = ["BASES", "HUB_WEIGHTS", "exported_presses", "press_status"]

BASES = ("BasePress", "ScorerPress")
"""kvpress's base classes: no press of their own."""

HUB_WEIGHTS = ("ExpectedAttentionStatsPress", "KVzapPress", "QFilterPress")
"""Bridged presses that load weights from the Hugging Face Hub when built (no hub here)."""

_KINDS = {
    "scored": "its own score inside the prefill, the top n_keep positions per layer and KV head",
    "pyramid": "per-layer counts from PyramidKV's own get_layer_budget",
    "adakv": "per-head counts by AdaKV's allocation around an inner ScorerPress",
    "merging": "a prompt transformation: its inner ScorerPress's top n_keep positions per layer "
    "and KV head with their keys, each evicted value folded into its most cosine-similar kept "
    "neighbour by kvpress's own MergingPress.merge",
    "decoding": "compression during decoding: each row's whole cache every "
    "compression_interval steps, to target_size by its base press's own score (KnormPress, "
    "KeyDiffPress or StreamingLLMPress)",
}


def exported_presses() -> list[str]:
    """The press classes the installed kvpress exports, sorted (``kvpress.__all__``'s subclasses
    of ``BasePress`` other than :data:`BASES`)."""
    import kvpress

    names = []
    for name in kvpress.__all__:
        obj = getattr(kvpress, name, None)
        if isinstance(obj, type) and issubclass(obj, kvpress.BasePress) and name not in BASES:
            names.append(name)
    return sorted(names)


def press_status(name: str) -> tuple[str, str]:
    """``("bridged", how)`` or ``("refused", why)`` for the kvpress press class ``name``, as the
    bridge decides it (:func:`kvdiverge.eviction.kvpress_bridge._press_kind`)."""
    import kvpress

    from kvdiverge.eviction.kvpress_bridge import _press_kind

    try:
        kind = _press_kind(getattr(kvpress, name), "press")
    except ActionError as exc:
        return "refused", str(exc).split(" is refused: ", 1)[-1]
    how = _KINDS[kind]
    if name in HUB_WEIGHTS:
        how += "; loads its weights from the Hugging Face Hub"
    return "bridged", how
