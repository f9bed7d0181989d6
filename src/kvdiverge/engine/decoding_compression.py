"""Compression during decoding in the engine: each row's own kept entries, re-compressed from
its own history (:mod:`kvdiverge.eviction.decoding`; ``docs/engine.md``, "Compression during
decoding").

A decoding action's Y and Z rows attend, like any action's, to the action's prompt part (held
once for all its rows) and to their own generated entries (:class:`RowCache`). What a row keeps
of the two is a mask per layer, KV head and entry, held in :class:`CompressingRowCache` beside
the entries and moved with them (ended rows leaving the batch, a Z row starting from a copy of
its Y row at the split). After every model call, each row whose schedule says so
(:func:`kvdiverge.eviction.decoding.checked_schedule`) hands its layer cache, in its order, to
the action's compressor and keeps what it returns; nothing is copied or moved, the evicted
entries are masked out of the row's attention from the next call on. The row's softmax is then
over exactly its kept entries: the same law as a plain forward over a cache holding only them
(tested against one, ``tests/engine/test_decoding_compression.py``).

Until a row of a group first evicts something, the group attends through the unmasked path,
as a full-cache action does (so a compressor that never evicts gives the full control's bits);
from then on its rows' prompt parts go through the masked prompt kernel with one bias row per
batch row, and their own entries through the float32 reference with the row's mask as a bias.
A batch without a decoding action builds none of this (:func:`row_cache` returns the plain
:class:`RowCache`), so prompt selection runs exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvdiverge.engine import kernels
from kvdiverge.engine.attention import RowCache, SharedPrefix
from kvdiverge.engine.generated_quantization import generated_quantizer
from kvdiverge.engine.kernels.reference import math_attention
from kvdiverge.eviction.contract import user_call
from kvdiverge.eviction.decoding import checked_kept, checked_schedule

__all__ = ["CompressingRowCache", "DecodingSpec", "row_cache"]


@dataclass
class DecodingSpec:
    """A decoding action's part of an intervention: the action, its schedule, its prompt
    length ``n`` and the absolute positions (per layer (H_kv, n_g)) of its prompt part's
    entries."""

    action: Any
    interval: int
    max_entries: int
    n: int
    positions: list[torch.Tensor]

    @classmethod
    def of(cls, action: Any, kept: torch.Tensor, n: int) -> DecodingSpec:
        """From the action and its kept prompt positions (L, H_kv, n_g) (every position, for a
        compressor that keeps the whole prompt after the prefill)."""
        interval, max_entries = checked_schedule(action)
        return cls(action, interval, max_entries, n, list(kept.unbind(0)))


def row_cache(
    units: Sequence[Any],
    evicted: Sequence[Sequence[int]],
    n_layers: int,
    rows: int,
    n_kv: int,
    head_dim: int,
    capacity: int,
    dtype: torch.dtype,
    device: torch.device,
) -> RowCache:
    """The batch's row cache: a :class:`CompressingRowCache` when an evicting intervention of
    some unit decodes with compression (``evicted[u]``: unit u's evicting interventions, in
    row-group order), else the plain :class:`RowCache`; with the quantizer of the generated
    entries of those that quantize them as they age, if any
    (:func:`kvdiverge.engine.generated_quantization.generated_quantizer`)."""
    groups: list[DecodingSpec | None] = []
    initial: list[tuple[int, int, bool]] = []
    for unit, members in zip(units, evicted, strict=True):
        base = len(groups)
        specs = [None] + [unit.interventions[i].decoding for i in members]
        groups += specs
        for gi in range(len(specs)):
            initial += [(base + gi, rep, gi > 0) for rep in range(len(unit.replicates))]
    args = (n_layers, rows, n_kv, head_dim, capacity, dtype, device)
    if all(spec is None for spec in groups):
        cache = RowCache(*args)
    else:
        cache = CompressingRowCache(*args, groups=groups, initial=initial)
    cache.aging = generated_quantizer(units, evicted)  # None unless some action quantizes them
    return cache


class CompressingRowCache(RowCache):
    """A :class:`RowCache` whose rows keep what their decoding compressor says (module
    docstring). ``groups[g]``: row group g's :class:`DecodingSpec` (None: not compressed);
    ``initial``: per batch row at the start, (group, replicate, whether it is a Y row)."""

    compressing = True

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        groups: list[DecodingSpec | None],
        initial: list[tuple[int, int, bool]],
    ) -> None:
        super().__init__(n_layers, batch, n_kv_heads, head_dim, capacity, dtype, device)
        self.groups = groups
        width = max(spec.positions[0].shape[-1] for spec in groups if spec is not None)
        shape = (batch, n_kv_heads)
        self.own_kept = [
            torch.ones((*shape, capacity), dtype=torch.bool, device=device) for _ in range(n_layers)
        ]
        self.prompt_kept = [
            torch.ones((*shape, width), dtype=torch.bool, device=device) for _ in range(n_layers)
        ]
        # host state per batch row: (group, replicate, Y row), its cache order per layer (None:
        # never compressed), and per layer its entries, calls since its last compression and
        # its own length then
        self.info: list[tuple[int, int, bool]] = list(initial)
        self.order: list[list[torch.Tensor | None]] = [[None] * n_layers for _ in initial]
        self.count = np.zeros((batch, n_layers), dtype=np.int64)
        self.calls = np.zeros((batch, n_layers), dtype=np.int64)
        self.since = np.zeros((batch, n_layers), dtype=np.int64)
        for r, (g, _, _) in enumerate(initial):
            spec = groups[g]
            if spec is not None:
                self.count[r] = [p.shape[-1] for p in spec.positions]
        self.active = [False] * len(groups)  # some row of the group has evicted an entry
        self.kept_y: dict[tuple[int, int], np.ndarray] = {}  # Y rows' entries at their last call
        self._bias: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- the rows move with their entries ------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        start = self.lengths[layer_idx]
        out = super().update(key_states, value_states, layer_idx, cache_kwargs)
        self.own_kept[layer_idx][: self.rows, :, start : self.lengths[layer_idx]] = True
        return out

    def copy_rows(self, source: torch.Tensor, target: torch.Tensor) -> None:
        super().copy_rows(source, target)
        for layer, length in enumerate(self.lengths):
            self.own_kept[layer][target, :, :length] = self.own_kept[layer][source, :, :length]
            self.prompt_kept[layer][target] = self.prompt_kept[layer][source]
        for s, t in zip(source.tolist(), target.tolist(), strict=True):
            g, rep, _ = self.info[s]
            row = (g, rep, False)
            if t < len(self.info):
                self.info[t], self.order[t] = row, list(self.order[s])
            else:
                self.info.append(row)
                self.order.append(list(self.order[s]))
            for table in (self.count, self.calls, self.since):
                table[t] = table[s]
        self._bias.clear()

    def keep_rows(self, rows: torch.Tensor) -> None:
        super().keep_rows(rows)
        for layer, length in enumerate(self.lengths):
            n = rows.numel()
            self.own_kept[layer][:n, :, :length] = self.own_kept[layer][rows, :, :length]
            self.prompt_kept[layer][:n] = self.prompt_kept[layer][rows]
        index = rows.tolist()
        self.info = [self.info[r] for r in index]
        self.order = [self.order[r] for r in index]
        for table in (self.count, self.calls, self.since):
            table[: len(index)] = table[index]
        self._bias.clear()

    # ---- compression after each model call ----------------------------------------------------
    def after_call(self, shared: SharedPrefix) -> None:
        """The call appended one entry to every running row: count it, record the Y rows'
        entries, and compress each row's layers whose schedule is due."""
        length = self.lengths[0]
        for r in range(self.rows):
            g, rep, is_y = self.info[r]
            spec = self.groups[g]
            if spec is None:
                continue
            self.count[r] += 1
            self.calls[r] += 1
            if is_y:
                self.kept_y[(g, rep)] = self.count[r].copy()
            due = np.zeros(len(self.lengths), dtype=bool)
            if spec.interval:
                due |= self.calls[r] >= spec.interval
            if spec.max_entries:
                due |= self.count[r] > spec.max_entries
            for layer in np.flatnonzero(due).tolist():
                self._compress(r, g, spec, layer, length, shared.prompts[g][layer])

    def _compress(
        self, r: int, g: int, spec: DecodingSpec, layer: int, length: int, part: tuple
    ) -> None:
        pk, pv = part[0], part[1]
        n_kv, n_g, d = pk.shape
        device = pk.device
        order = self.order[r][layer]
        fresh = torch.arange(n_g + self.since[r, layer], n_g + length, device=device)
        if order is None:
            order = torch.arange(n_g + length, device=device).expand(n_kv, -1)
        else:
            order = torch.cat([order, fresh.expand(n_kv, -1)], dim=1)
        keys = torch.cat([pk, self.keys[layer][r, :, :length]], dim=1)
        values = torch.cat([pv, self.values[layer][r, :, :length]], dim=1)
        generated = spec.n + torch.arange(length, device=device).expand(n_kv, -1)
        positions = torch.cat([spec.positions[layer], generated], dim=1)
        index = order[..., None].expand(-1, -1, d)
        row_k, row_v = keys.gather(1, index), values.gather(1, index)
        row_p = positions.gather(1, order)
        action = spec.action
        method = action.method
        kept = user_call(action, "compress", method.compress, action, layer, row_k, row_v, row_p)
        kept = checked_kept(kept, action, layer, n_kv, order.shape[1]).to(device)
        new = order.gather(1, kept)
        full = torch.zeros((n_kv, n_g + length), dtype=torch.bool, device=device)
        full.scatter_(1, new, True)
        self.prompt_kept[layer][r, :, :n_g] = full[:, :n_g]
        self.own_kept[layer][r, :, :length] = full[:, n_g:]
        self.order[r][layer] = new
        if new.shape[1] < order.shape[1]:
            self.active[g] = True
        self.count[r, layer] = new.shape[1]
        self.calls[r, layer] = 0
        self.since[r, layer] = length
        self._bias.clear()

    # ---- attention over each row's kept entries -----------------------------------------------
    def attend(
        self,
        prefix: SharedPrefix,
        layer: int,
        q: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        o_own: torch.Tensor,
        lse_own: torch.Tensor,
        o_pre: torch.Tensor,
        lse_pre: torch.Tensor,
    ) -> None:
        """Overwrite, for the rows of every group that has evicted something, the prompt and own
        parts of the attention by their masked ones (q: (B, H_kv, G, d); key, value: the rows'
        own entries (B, H_kv, t, d))."""
        n_kv, groups, d = q.shape[1], q.shape[2], q.shape[3]
        t = key.shape[2]
        for g, spec in enumerate(self.groups):
            rows = prefix.rows[g]
            if spec is None or not self.active[g] or not rows.numel():
                continue
            pk, pv = prefix.prompts[g][layer][:2]
            table, index = self._prompt_bias(layer, g, rows, pk.shape[1], groups)
            qr = q.index_select(0, rows)
            qg = qr.transpose(0, 1).reshape(n_kv, rows.numel() * groups, d)
            o, lse = kernels.attend_prompt(
                "prompt_masked", qg, pk, pv, scale, table, index, prefix.fused, prefix.native
            )
            o_pre.index_copy_(0, rows, o.reshape(n_kv, rows.numel(), groups, d).transpose(0, 1))
            lse_pre.index_copy_(0, rows, lse.reshape(n_kv, rows.numel(), groups).transpose(0, 1))
            mask = self.own_kept[layer].index_select(0, rows)[:, :, None, :t]
            bias = torch.zeros(mask.shape, dtype=torch.float32, device=q.device)
            bias.masked_fill_(~mask, float("-inf"))
            own_o, own_lse = math_attention(
                qr, key.index_select(0, rows), value.index_select(0, rows), scale, bias
            )
            o_own.index_copy_(0, rows, own_o)
            lse_own.index_copy_(0, rows, own_lse)

    def _prompt_bias(
        self, layer: int, g: int, rows: torch.Tensor, width: int, groups: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, H_kv, n_g) float32 additive masks of group g's rows and each query row's index
        into them (built once per layer until a row compresses or the rows move)."""
        if (layer, g) not in self._bias:
            kept = self.prompt_kept[layer].index_select(0, rows)[:, :, :width]
            table = torch.zeros(kept.shape, dtype=torch.float32, device=kept.device)
            table.masked_fill_(~kept, float("-inf"))
            index = torch.arange(rows.numel(), dtype=torch.int32, device=kept.device)
            self._bias[(layer, g)] = (table, index.repeat_interleave(groups))
        return self._bias[(layer, g)]

    # ---- outcomes -----------------------------------------------------------------------------
    def add_outcomes(self, arrays: list[list[dict[str, np.ndarray]]], evicted: list[list[int]]):
        """Each decoding intervention's ``kept_entries`` (k, L): the entries per KV head and
        layer each replicate's Y row held at its last decoding call."""
        g = 0
        for unit_arrays, members in zip(arrays, evicted, strict=True):
            g += 1  # the unit's X group
            for i in members:
                spec = self.groups[g]
                if spec is not None:
                    k = len(unit_arrays[i]["x_token"])
                    prompt = [p.shape[-1] for p in spec.positions]
                    table = np.array([self.kept_y.get((g, rep), prompt) for rep in range(k)])
                    unit_arrays[i]["kept_entries"] = table.astype(np.int64)
                g += 1
