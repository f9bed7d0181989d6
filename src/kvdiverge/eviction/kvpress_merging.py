"""kvpress's ``MergingPress`` as a prompt transformation (:mod:`kvdiverge.eviction.transforms`).

An action ``{selector: kvpress, press: MergingPress, budget: b, press_kwargs: {press: S,
similarity_threshold: τ, merge_fraction: f}}`` keeps, per layer and KV head, the ``n_keep``
top-scored positions K of the inner ScorerPress S (its own ``score`` inside the prefill, as
:mod:`kvdiverge.eviction.kvpress_bridge` runs every scorer, and kvpress's ``topk`` of those
scores), with their keys unchanged, and folds each evicted entry's value into its most
cosine-similar kept neighbour. For an evicted position e with key k_e and value v_e:

* its target t(e) = argmax_{j ∈ K} cos(k_e, k_j) and similarity s_e, the maximum (keys in
  float32, each divided by max(‖k‖, ε));
* it merges when s_e >= τ and, when f < 1, s_e is at or above the (1 − f)-quantile of the
  similarities of the evicted entries that pass τ (the others counted as −∞);
* its weight w_e = max(s_e, 0) · ‖v_e‖ / (‖v_e‖ + ‖v_{t(e)}‖ + ε) if it merges, else 0;
* each kept j's value becomes (v_j + Σ_{t(e)=j} w_e v_e) / (1 + Σ_{t(e)=j} w_e), accumulated in
  float32 and cast back to the cache's dtype, where Σ w_e > 0; else v_j unchanged.

The merge is kvpress's own ``MergingPress.merge``, called on the prefill's keys and values with
the kept positions in the order kvpress's ``topk`` gives them, so the cache is the one kvpress's
own pipeline leaves (``tests/eviction/test_kvpress_merging.py``); this transformation returns
the kept entries in ascending position order (the layout of a gathered kept set), the same
entries in another order (the attention's sums then run in another order: float rounding
only). On a CUDA device kvpress's ``scatter_add_`` adds the evicted values with atomics, in no
fixed order, so the merged values there may differ from run to run in their last bits (on the
CPU they are the same bit for bit). Bytes (:func:`merging_layer_bytes`): the kept entries only,
n_keep × 2 × d × the dtype's bytes per KV head, as the scorer keeping the same positions holds.
"""

from __future__ import annotations

import numbers
import typing
from collections.abc import Mapping
from typing import Any

from kvdiverge.eviction.budgets import ActionError

if typing.TYPE_CHECKING:  # torch is imported where it runs: parsing a config does not load it
    import torch

__all__ = [
    "check_merging_kwargs",
    "merged_entries",
    "merging_indices",
    "merging_layer_bytes",
]


def check_merging_kwargs(kwargs: Mapping[str, Any], where: str) -> None:
    """MergingPress's keyword arguments before the press is built (kvpress's own checks are
    bare assertions): ``press`` given, ``similarity_threshold`` a number in [0, 1],
    ``merge_fraction`` a number in (0, 1]; one :class:`ActionError` line naming the keyword."""
    if kwargs.get("press") is None:
        raise ActionError(
            f"{where}.press_kwargs.press: required for MergingPress: the ScorerPress whose top "
            "positions are kept (e.g. press: SnapKVPress)"
        )
    limits = {"similarity_threshold": (0.0, True), "merge_fraction": (0.0, False)}
    for key, (low, closed) in limits.items():
        if key not in kwargs:
            continue
        value = kwargs[key]
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        inside = number and (low <= value if closed else low < value) and value <= 1.0
        if not inside:
            interval = "[0, 1]" if closed else "(0, 1]"
            raise ActionError(
                f"{where}.press_kwargs.{key}: expected a number in {interval}, got {value!r}"
            )


def merging_indices(scores: torch.Tensor, n_keep: int) -> torch.Tensor:
    """The kept positions (H_kv, n_keep) of one layer from its scores (H_kv, n), in the order
    kvpress's ``MergingPress.compress`` takes them: ``topk`` of the (1, H_kv, n) scores."""
    return scores.unsqueeze(0).topk(n_keep, dim=-1).indices[0]


def merged_entries(
    press: Any, keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cache after MergingPress: kvpress's own ``press.merge`` of the layer's keys
    and values (H_kv, n, d) at the kept ``indices`` (H_kv, n_keep, in kvpress's topk order),
    then the kept keys and merged values gathered in ascending position order (new tensors;
    the inputs are left as they are)."""
    _, merged = press.merge(keys.unsqueeze(0), values.unsqueeze(0), indices.unsqueeze(0))
    ascending = indices.sort(dim=-1).values
    index = ascending.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
    return keys.gather(1, index).contiguous(), merged[0].gather(1, index).contiguous()


def merging_layer_bytes(n_keep: int, n_kv: int, head_dim: int, itemsize: int) -> int:
    """Bytes of one layer's merged cache: ``n_kv`` KV heads of ``n_keep`` entries, keys and
    values of ``head_dim`` elements of ``itemsize`` bytes (the kept subset's own bytes)."""
    return n_kv * n_keep * 2 * head_dim * itemsize
