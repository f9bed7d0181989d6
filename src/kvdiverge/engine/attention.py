"""Shared-prefix attention: every decoding row attends to a prompt cache held once per row group.

The engine's model calls (``docs/architecture.md``, "Shared-prefix attention") decode many rows
at once — the reference rows X on the full prompt cache, each action's rows Y and Z on its
evicted cache. A prompt part is one tensor for all the rows of its group, never copied per row:
:func:`shared_prefix_attention` (registered with transformers' ``AttentionInterface`` as
:data:`ATTENTION_NAME`) scores each group's queries against its prompt part in one batched
product, scores each row's own generated entries (:class:`RowCache`) separately, and merges the
two exactly by their log-sum-exp. Every product runs through the kernel registry
(:mod:`kvdiverge.engine.kernels`): the native prompt kernel, a library kernel or the float32
reference, whichever is validated first for the layout, device, dtype and head size.

Two layouts serve a document's prompt groups (``docs/architecture.md``, "Shared-prefix
attention"): the gathered one scores each group's queries against its own gathered kept entries
(a few rows against thousands of entries: bound by memory), and the masked one
(:class:`PromptPass`) scores the queries of several groups of one document in ONE product
against the document's full prompt cache, each group's evicted entries masked out per layer and
KV head (ragged kept sets included), so the prompt is read for those rows together (by the CPU
flash kernel once per block of 32 or 64 queries) instead of once per group; the masked entries
cost arithmetic, not memory. Both give each row the same softmax over its kept entries, to float
rounding; which wins depends on the kept fraction (``RolloutSettings.prompt_attention``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvdiverge.engine import kernels
from kvdiverge.engine.families import check_attention_call

__all__ = [
    "ATTENTION_NAME",
    "PromptPass",
    "RowCache",
    "SharedPrefix",
    "attention_implementation",
    "shared_prefix_attention",
]

log = logging.getLogger(__name__)

ATTENTION_NAME = "kvdiverge_shared_prefix"


@dataclass
class PromptPass:
    """Row groups of one document that attend to its full prompt cache in ONE masked product.

    ``groups``: indices into :attr:`SharedPrefix.rows` (their entry of ``prompts`` is not read);
    ``prompt[l] = (keys, values)``: the document's full cache of layer l, (H_kv, n, d);
    ``masks[i]``: group ``groups[i]``'s kept entries, per layer a (H_kv, n) bool tensor (true:
    kept), or ``None`` when it keeps every entry (the X rows, the full-retention control).
    """

    groups: list[int]
    prompt: list[tuple[torch.Tensor, torch.Tensor]]
    masks: list[list[torch.Tensor] | None]

    def __post_init__(self) -> None:
        # the entries each group keeps per layer and KV head, on average (arithmetic counts;
        # read once per document, not per step)
        n = self.prompt[0][0].shape[-2]
        self.kept = [
            float(n)
            if m is None
            else float(sum(int(x.sum()) for x in m)) / sum(x.numel() // n for x in m)
            for m in self.masks
        ]
        # each group's row in the per-layer bias table (−1: no mask)
        self.bias_rows: list[int] = []
        for mask in self.masks:
            self.bias_rows.append(-1 if mask is None else sum(r >= 0 for r in self.bias_rows))
        self._tables: dict[int, torch.Tensor] = {}
        self._indices: dict[tuple, torch.Tensor] = {}

    def bias_table(self, layer: int) -> torch.Tensor | None:
        """(groups with a mask, H_kv, n) float32: their additive masks of ``layer`` (0 where
        kept, −inf elsewhere; built once per layer)."""
        masks = [m[layer] for m in self.masks if m is not None]
        if not masks:
            return None
        if layer not in self._tables:
            inf = float("-inf")
            self._tables[layer] = torch.stack(
                [torch.zeros(m.shape, device=m.device).masked_fill_(~m, inf) for m in masks]
            )
        return self._tables[layer]

    def row_index(self, groups: list[int], counts: list[int], device: torch.device) -> torch.Tensor:
        """(Σ counts,) int32: each query row's index into the bias table, for the pass's groups
        ``groups`` (positions in :attr:`groups`) holding ``counts`` query rows each (built once
        per row layout: one host-to-device copy, not one per layer and step)."""
        key = (tuple(groups), tuple(counts))
        if key not in self._indices:
            index = [self.bias_rows[i] for i in groups]
            rows = torch.tensor(index, dtype=torch.int32).repeat_interleave(torch.tensor(counts))
            self._indices[key] = rows.to(device)
        return self._indices[key]

    def call(self, chosen: list[int], counts: list[int], layer: int, groups: int) -> tuple:
        """The prompt kernel's arguments for the pass's groups ``chosen`` (positions in
        :attr:`groups`, with ``counts`` batch rows each) at ``layer``, ``groups`` query heads per
        KV head: (layout, keys, values, bias table, row index) — the dense ``prompt_gathered``
        layout when none of them has a mask."""
        pk, pv = self.prompt[layer]
        if all(self.masks[i] is None for i in chosen):
            return "prompt_gathered", pk, pv, None, None
        index = self.row_index(chosen, [c * groups for c in counts], pk.device)
        return "prompt_masked", pk, pv, self.bias_table(layer), index


_RAGGED = WeakIdKeyDictionary()  # a ragged part's padding mask → its (1, H_kv, n) bias
_CALLS = WeakIdKeyDictionary()  # a SharedPrefix → its plan's kernel arguments per layer


def _gathered_call(
    prompt: list[tuple[torch.Tensor, ...]], n_rows: int, layer: int, groups: int
) -> tuple:
    """A gathered prompt part's kernel arguments at ``layer`` for ``n_rows`` batch rows:
    ``prompt_gathered``, or ``prompt_ragged`` with its padding masked by one bias row."""
    pk, pv, *mask = prompt[layer]
    if not mask:
        return "prompt_gathered", pk, pv, None, None
    table = _RAGGED.get(mask[0])
    if table is None:
        table = torch.zeros((1, *mask[0].shape), dtype=torch.float32, device=mask[0].device)
        table[0].masked_fill_(~mask[0], float("-inf"))
        _RAGGED[mask[0]] = table
    index = torch.zeros(n_rows * groups, dtype=torch.int32, device=pk.device)
    return "prompt_ragged", pk, pv, table, index


@dataclass
class SharedPrefix:
    """The shared prompt parts of a model call (passed as the ``kvd_prefix`` kwarg).

    Row group g — the batch rows ``rows[g]`` (a LongTensor) — attends to the prompt part
    ``prompts[g][l] = (keys, values)`` of layer l, each of shape (H_kv, n_g, d): the full cache
    for the X rows, an action's evicted cache for its Y and Z rows. A prompt part is one tensor
    for all its rows, never copied per row (docs/architecture.md, "Shared-prefix attention").
    A ragged part (KV heads keeping different counts, e.g. kvpress's AdaKV) is padded to its
    longest head and carries a third element, ``mask`` (H_kv, n_g), false at the padding: those
    entries get no attention weight.
    """

    rows: list[torch.Tensor]
    prompts: list[list[tuple[torch.Tensor, torch.Tensor]]]
    fused: bool = True  # use a validated fused attention kernel where one exists
    passes: list[PromptPass] = field(default_factory=list)  # masked passes over full prompts
    native: bool = True  # with ``fused``: the native prompt kernel where built and validated
    # compression during decoding: the cache whose rows mask their evicted entries
    # (:class:`kvdiverge.engine.decoding_compression.CompressingRowCache`), else None
    decoding: Any = None
    _plan: list | None = field(default=None, init=False, repr=False, compare=False)

    def plan(self) -> list[tuple[torch.Tensor, Callable[[int, int], tuple]]]:
        """The prompt products of a model call, built once per row layout: per product its batch
        rows and a function of (layer, query heads per KV head) giving the kernel's arguments
        (layout, keys, values, bias table, row index). A masked pass's groups run in one
        product; every other group with running rows against its own part."""
        if self._plan is None:
            plan, in_pass = [], set()
            for part in self.passes:
                in_pass.update(part.groups)
                chosen = [i for i, g in enumerate(part.groups) if self.rows[g].numel()]
                if not chosen:  # every row of these groups has ended
                    continue
                rows = torch.cat([self.rows[part.groups[i]] for i in chosen])
                counts = [self.rows[part.groups[i]].numel() for i in chosen]
                plan.append((rows, functools.partial(part.call, chosen, counts)))
            for g, (rows, prompt) in enumerate(zip(self.rows, self.prompts, strict=True)):
                if g not in in_pass and rows.numel():
                    plan.append((rows, functools.partial(_gathered_call, prompt, rows.numel())))
            self._plan = plan
        return self._plan

    def kept_entries(self) -> list[float]:
        """Per row group: the prompt entries its rows attend to per layer and KV head (their
        mean for ragged or masked kept sets; a padded ragged part counts its width)."""
        out = [float(prompt[0][0].shape[1]) for prompt in self.prompts]
        for part in self.passes:
            for g, kept in zip(part.groups, part.kept, strict=True):
                out[g] = kept
        return out


class RowCache:
    """Decode cache holding only each row's own generated entries.

    Preallocated (B, H_kv, capacity, d) per layer for up to B rows. A model call runs the
    first ``rows`` of them (all by default); ``update`` appends the step's entries of those
    rows and returns their filled part (views, no copy). Every running row advances one entry
    per step; :meth:`copy_rows` starts a new row from another row's history.
    """

    is_compileable = False
    compressing = False  # rows keep every entry (a CompressingRowCache's rows mask theirs)
    aging: Any = None  # a GeneratedQuantizer (generated entries quantized as they age)

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (batch, n_kv_heads, capacity, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lengths = [0] * n_layers
        self.rows = batch

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (rows, H_kv, q, d) entries for layer ``layer_idx``; return all of that layer's."""
        start = self.lengths[layer_idx]
        stop = start + key_states.shape[-2]
        rows = self.rows
        self.keys[layer_idx][:rows, :, start:stop] = key_states
        self.values[layer_idx][:rows, :, start:stop] = value_states
        self.lengths[layer_idx] = stop
        return self.keys[layer_idx][:rows, :, :stop], self.values[layer_idx][:rows, :, :stop]

    def copy_rows(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Give rows ``target`` the generated entries held so far by rows ``source``."""
        for layer, length in enumerate(self.lengths):
            for part in (self.keys[layer], self.values[layer]):
                part[target, :, :length] = part[source, :, :length]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only rows ``rows`` (in that order), moved to the front."""
        for layer, length in enumerate(self.lengths):
            for part in (self.keys[layer], self.values[layer]):
                part[: rows.numel(), :, :length] = part[rows, :, :length]
        self.rows = rows.numel()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Generated entries held for ``layer_idx`` (the prompt part is not in this cache)."""
        return self.lengths[layer_idx]


def shared_prefix_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over (shared prompt part) ∪ (each row's own generated part), merged exactly.

    ``query`` (B, H, q, d); ``key``/``value`` (B, H_kv, t, d) are the rows' own entries (from
    :class:`RowCache`, the current one included). The shared prompt part arrives as the
    ``kvd_prefix`` kwarg (:class:`SharedPrefix`); each row group's queries (grouped-query
    heads folded) are scored against its prompt part in one product. Without it this is plain
    SDPA attention. Each part gives a normalised output and its log-sum-exp; the exact softmax
    over the union is their mix with weight sigmoid(lse_prompt − lse_own) (log-sum-exp merge,
    docs/architecture.md, "Shared-prefix attention"). Every product goes through the kernel
    registry (:mod:`kvdiverge.engine.kernels`): ``rows_own`` for the rows' own entries (the
    native kernel merges them with the prompt parts in its pass), ``prompt_gathered``/
    ``prompt_ragged`` for a group's gathered part, ``prompt_masked`` for a masked pass.
    The signature is transformers' own (``sdpa_attention_forward``'s order: ``dropout`` before
    ``scaling``), so wrappers that pass ``dropout`` by position, as kvpress's does, work.
    Returns (B, q, H, d) like transformers' attention functions.
    """
    prefix: SharedPrefix | None = kwargs.pop("kvd_prefix", None)
    if prefix is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    # a soft cap, sinks, a window shorter than the keys, anything unknown: refused, one line
    check_attention_call(
        kwargs, lambda: key.shape[2] + max(p[0][0].shape[1] for p in prefix.prompts)
    )
    batch, n_heads, q_len, d = query.shape
    if q_len != 1:
        raise ValueError("shared_prefix_attention decodes one token per row and step")
    n_kv = key.shape[1]
    groups = n_heads // n_kv
    scale = float(scaling if scaling is not None else d**-0.5)
    layer = module.layer_idx
    q = query.reshape(batch, n_kv, groups, d)
    # (B, H_kv, G, d), (B, H_kv, G)
    flags = {"fused": prefix.fused, "native": prefix.native}
    # the prompt parts first, then the own part merged with them; the outputs are scattered in
    # the prompt kernels' layout (H_kv, rows × G, ·), along the rows of (H_kv, B, G, ·) buffers
    # that the merge reads as (B, H_kv, G, ·) views
    o_pre = torch.empty((n_kv, batch, groups, d), dtype=torch.float32, device=q.device)
    lse_pre = torch.empty((n_kv, batch, groups), dtype=torch.float32, device=q.device)
    calls = _CALLS.get(prefix)
    if calls is None:
        calls = _CALLS[prefix] = {}
    for i, (rows, run) in enumerate(prefix.plan()):
        n_rows = rows.numel()
        qg = q.index_select(0, rows).transpose(0, 1).reshape(n_kv, n_rows * groups, d)
        args = calls.get((i, layer, groups))
        if args is None:  # the kernel's arguments: fixed while the row layout stays
            args = calls[(i, layer, groups)] = run(layer, groups)
        layout, pk, pv, table, row_index = args
        o, lse = kernels.attend_prompt(layout, qg, pk, pv, scale, table, row_index, **flags)
        o_pre.index_copy_(1, rows, o.reshape(n_kv, n_rows, groups, d))
        lse_pre.index_copy_(1, rows, lse.reshape(n_kv, n_rows, groups))
    o_pre, lse_pre = o_pre.transpose(0, 1), lse_pre.transpose(0, 1)
    if prefix.decoding is None:
        out, _ = kernels.attend_own(q, key, value, scale, **flags, prompt=(o_pre, lse_pre))
    else:  # rows compressed during decoding: their kept entries only, then the merge
        o_own, lse_own = kernels.attend_own(q, key, value, scale, **flags)
        prefix.decoding.attend(prefix, layer, q, key, value, scale, o_own, lse_own, o_pre, lse_pre)
        out = kernels.dispatch.merge(o_own, lse_own, o_pre, lse_pre)
    return out.reshape(batch, n_heads, 1, d).transpose(1, 2).to(query.dtype), None


AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention)


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Run ``model`` with the registered attention function ``name`` inside the block."""
    old = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(old)
