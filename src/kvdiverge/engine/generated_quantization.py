"""Each row's own generated entries quantized as they age: KIVI's streaming part, for a
``selector: quantize`` action with ``generated: true`` (:mod:`kvdiverge.eviction.quantize`,
whose docstring defines it; ``docs/compression.md``, "Quantized caches").

A row's own generated entries live in the batch's :class:`~kvdiverge.engine.attention.RowCache`,
and every row of a batch holds the same count t of them per layer (each running row appends one
entry per call; a Z row starts from a copy of its Y row's). With b bits, group size G and window
r, KIVI's cache of a row's t entries quantizes the values of the first n_v(t) = t − min(r, t)
and the keys of the first n_k(t) = ⌊n_v(t)/G⌋·G (:func:`kvdiverge.eviction.quantize.kivi_split`
with n = t). Both counts only grow with t, by whole entries for the values and whole groups of
G for the keys, and each group is quantized from its own full-precision entries alone. So after
each model call :meth:`GeneratedQuantizer.after_call` replaces, in place and in every row of
each such action's row group (:attr:`~kvdiverge.engine.attention.SharedPrefix.rows`), only the
entries that have just aged — the values of entries n_v(t − 1) … n_v(t) − 1, the keys of the
group that has just left the window — by their dequantized values
(:func:`kvdiverge.eviction.quantize.quantize_dequantize_groups`); the rest were quantized
before or are still in the window. The row then holds exactly KIVI's cache of its own t
full-precision entries, and the next call attends to it.

A row's state is its entries: they move with it when ended rows leave the batch
(:meth:`RowCache.keep_rows`) and are copied into a Z row at the split (:meth:`RowCache.copy_rows`),
which inherits them as they are; what has been quantized is the same count for every row of a
group (kept per group). The X rows, the full control and every other action's rows are never
touched; a batch without such an action builds no quantizer (:func:`generated_quantizer` returns
``None``) and the decode loop runs as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvdiverge.eviction.quantize import QuantizeSelector, kivi_split, quantize_dequantize_groups

__all__ = ["GeneratedQuantization", "GeneratedQuantizer", "generated_quantizer"]


@dataclass(frozen=True)
class GeneratedQuantization:
    """An action's quantization of its rows' generated entries: ``bits``, ``group_size`` G and
    ``residual`` r, those of its prompt cache."""

    bits: int
    group_size: int
    residual: int

    @classmethod
    def of(cls, action: Any) -> GeneratedQuantization | None:
        """The action's, for a ``quantize`` action with ``generated: true``; else ``None``."""
        method = getattr(action, "method", None)
        if not (isinstance(method, QuantizeSelector) and method.generated):
            return None
        return cls(method.bits, method.group_size, method.residual)

    def quantized(self, t: int) -> tuple[int, int]:
        """(n_k, n_v): of t generated entries, those whose keys and whose values are quantized."""
        return kivi_split(t, self.group_size, self.residual)


def _values(part: torch.Tensor, rows: torch.Tensor, start: int, stop: int, bits: int, g: int):
    """Values of entries start … stop − 1 of batch rows ``rows`` (part: (B, H_kv, T, d)),
    quantized per token in groups of g channels, in place."""
    block = part[rows, :, start:stop]
    r, h, m, d = block.shape
    done = quantize_dequantize_groups(block.reshape(r, h, m, d // g, g), bits)
    part[rows, :, start:stop] = done.reshape(r, h, m, d)


def _keys(part: torch.Tensor, rows: torch.Tensor, start: int, stop: int, bits: int, g: int):
    """Keys of entries start … stop − 1 (whole groups of g) of batch rows ``rows``, quantized per
    channel in groups of g consecutive entries, in place."""
    block = part[rows, :, start:stop]
    r, h, m, d = block.shape
    grouped = block.reshape(r, h, m // g, g, d).transpose(-1, -2)
    done = quantize_dequantize_groups(grouped, bits).transpose(-1, -2)
    part[rows, :, start:stop] = done.reshape(r, h, m, d)


class GeneratedQuantizer:
    """The batch's row groups whose generated entries age into quantized ones (module docstring).

    ``groups[g]``: row group g's :class:`GeneratedQuantization` (``None``: left as it is), in the
    order of :attr:`SharedPrefix.rows`; ``done[g]``: (n_k, n_v) already quantized in its rows.
    """

    def __init__(self, groups: Sequence[GeneratedQuantization | None]) -> None:
        self.groups = list(groups)
        self.done = [(0, 0)] * len(self.groups)

    def after_call(self, cache: Any, shared: Any) -> None:
        """After a model call: in each group's rows (``shared.rows``), quantize in place the
        generated entries of ``cache`` (a :class:`RowCache`) that have aged since the last call."""
        t = cache.lengths[0]
        for g, spec in enumerate(self.groups):
            if spec is None:
                continue
            done_k, done_v = self.done[g]
            n_k, n_v = spec.quantized(t)
            rows = shared.rows[g]
            if rows.numel() and (n_k > done_k or n_v > done_v):
                bits, size = spec.bits, spec.group_size
                for keys, values in zip(cache.keys, cache.values, strict=True):
                    if n_v > done_v:
                        _values(values, rows, done_v, n_v, bits, size)
                    if n_k > done_k:
                        _keys(keys, rows, done_k, n_k, bits, size)
            self.done[g] = (n_k, n_v)


def generated_quantizer(
    units: Sequence[Any], evicted: Sequence[Sequence[int]]
) -> GeneratedQuantizer | None:
    """The batch's quantizer of generated entries (``evicted[u]``: unit u's evicting
    interventions, in row-group order, each unit's X group first), or ``None`` when no
    intervention quantizes its generated entries."""
    groups: list[GeneratedQuantization | None] = []
    for unit, members in zip(units, evicted, strict=True):
        groups += [None] + [unit.interventions[i].aging for i in members]
    if all(spec is None for spec in groups):
        return None
    return GeneratedQuantizer(groups)
