"""What a prefill records for the selectors: each layer's keys, values and window queries, the
observed layers and the first-token logits (:func:`kvdiverge.eviction.run.run_prefill`)."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any

if typing.TYPE_CHECKING:  # torch is imported where it runs: parsing a config does not load it
    import torch


# ---- the prefill --------------------------------------------------------------------------------
@dataclass
class LayerInputs:
    """One attention layer as the prefill saw it: what kvpress passes to a press's ``score``.

    ``hidden_states`` (1, n, D): the layer's attention input; ``keys``/``values``
    (1, H_kv, n, d): its full cache, keys post-RoPE; ``attentions``: the attention
    probabilities (1, H, n, n) when the model returned them (eager attention), else ``None``;
    ``kwargs``: the attention forward's keyword arguments (``position_embeddings``,
    ``attention_mask``, ``cache_position``, ``past_key_values``).
    """

    layer: int
    module: torch.nn.Module
    hidden_states: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    attentions: torch.Tensor | None
    kwargs: dict[str, Any]


@dataclass
class Prefill:
    """The prompt's full KV cache and what selectors need from the prefill.

    ``keys[l]``/``values[l]``: (H_kv, n, d), keys post-RoPE. ``window_queries[l]``: (H, w, d)
    post-RoPE queries of the last w prompt positions (empty list when no selector needs them).
    ``last_logits``: (V,) next-token logits after the prompt (the first generated token's law,
    shared by the reference and every intervention, so δ_1 = 0). ``observed[action name][l]``:
    what the action's selector recorded from layer l during the prefill
    (:meth:`Selector.observe`). ``verified``: the digest (:meth:`digest`) last shown unchanged
    after a selector (:func:`kvdiverge.eviction.select_positions`), None before the first.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    window_queries: list[torch.Tensor]
    last_logits: torch.Tensor
    n: int
    num_key_value_groups: int
    head_dim: int
    observed: dict[str, list[Any]] = field(default_factory=dict)
    verified: Any = field(default=None, repr=False, compare=False)

    def digest(self) -> torch.Tensor:
        """A cheap digest of what every action reads (keys, values, window queries, logits and
        the sizes), to show that a selector left the prefill as it was
        (:func:`kvdiverge.eviction.contract.check_unchanged`).

        Per tensor, its bits read as integers are summed per row (last dimension) and the row
        sums combined with and without position weights: any change of a value, and rows
        exchanged, change it; one pass over the data, no copy of it.
        """
        import torch

        tensors = [*self.keys, *self.values, *self.window_queries, self.last_logits]
        device = self.last_logits.device
        sizes = [self.n, self.num_key_value_groups, self.head_dim, len(self.keys)]
        sizes += [len(self.values), len(self.window_queries)]
        parts = [torch.tensor(sizes, dtype=torch.int64, device=device)]
        for t in tensors:
            parts.append(_tensor_digest(t).to(device))
        return torch.cat(parts)


_INTEGER_VIEWS = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def _tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """(4,) int64: shape-independent size, numel, and the plain and position-weighted sums of
    the per-row sums of ``t``'s bits (integer wrap-around is deterministic)."""
    import torch

    t = t.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    if not t.is_contiguous():
        t = t.contiguous()
    bits = t.view(getattr(torch, _INTEGER_VIEWS[t.element_size()]))
    # row sums accumulate in int32 where the bits fit (wrapping around, deterministically):
    # several times faster than an int64 or float64 accumulation on the CPU
    accumulate = torch.int32 if t.element_size() <= 4 else torch.int64
    rows = bits.reshape(-1, t.shape[-1]).sum(dim=-1, dtype=accumulate).long()
    weights = torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=rows.device)
    return torch.stack(
        [
            torch.tensor(t.dim(), device=rows.device),
            torch.tensor(t.numel(), device=rows.device),
            rows.sum(),
            (rows * weights).sum(),
        ]
    )
