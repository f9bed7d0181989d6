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
    (:meth:`Selector.observe`).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    window_queries: list[torch.Tensor]
    last_logits: torch.Tensor
    n: int
    num_key_value_groups: int
    head_dim: int
    observed: dict[str, list[Any]] = field(default_factory=dict)
