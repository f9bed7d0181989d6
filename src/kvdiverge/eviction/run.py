"""Running eviction on a prompt: the prefill (:func:`run_prefill`) and the positions an action
keeps of it, per layer and KV head (:func:`select_positions`).

Namesake: :mod:`kvdiverge.compare.run` runs a whole ``kvdiverge compare`` study; this module
runs one prompt's prefill and selections.
"""

from __future__ import annotations

import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvdiverge.eviction.budgets import ActionError
from kvdiverge.eviction.contract import (
    check_unchanged,
    checked_n_keep,
    checked_positions,
    selector_label,
    user_call,
)
from kvdiverge.eviction.prefill import LayerInputs, Prefill, _tensor_digest
from kvdiverge.eviction.selectors import ActionSpec, _as_action

if typing.TYPE_CHECKING:
    import torch


def _rotary_fn(attn: torch.nn.Module) -> Callable:
    module = sys.modules[type(attn).__module__]
    fn = getattr(module, "apply_rotary_pos_emb", None)
    if fn is None:
        raise ActionError(
            f"model: attention class {type(attn).__name__} has no apply_rotary_pos_emb; "
            "SnapKV window queries need a RoPE model"
        )
    return fn


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = model.model.layers
    return [layer.self_attn for layer in layers]


def run_prefill(
    model: torch.nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    query_window: int = 0,
    actions: Sequence[ActionSpec | Mapping[str, Any]] = (),
) -> Prefill:
    """One prefill of the prompt: full cache, last logits, and what the actions' selectors need.

    ``query_window`` > 0 records the post-RoPE queries of the last ``query_window`` positions of
    every layer (SnapKV's observation window), computed from the layer's input exactly as
    kvpress does (q_proj with bias, q_norm when the model has one, RoPE); ``actions`` raise it
    to the largest window their selectors need. Each action whose selector observes the prefill
    (:attr:`Selector.observes`) and evicts something from this prompt is checked against it
    first, then sees every attention layer after its forward (:meth:`Selector.observe`, as a
    kvpress press's forward hook does); what it returns is kept in ``Prefill.observed``.
    """
    import torch

    with torch.no_grad():
        return _run_prefill(model, input_ids, query_window, actions)


def _run_prefill(
    model: torch.nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    query_window: int,
    actions: Sequence[ActionSpec | Mapping[str, Any]],
) -> Prefill:
    import torch

    device = next(model.parameters()).device
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device).reshape(1, -1)
    n = ids.shape[1]
    specs = [_as_action(a) for a in actions]
    windows = [user_call(a, "query_window", a.method.query_window, a) for a in specs]
    for a, size in zip(specs, windows, strict=True):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ActionError(
                f"action {a.name!r}: query_window returned {size!r}; expected an integer >= 0"
            )
    query_window = max([query_window, *windows])
    attns = _attention_modules(model)
    observers: list[tuple[ActionSpec, int]] = []
    for a in specs:
        n_keep = checked_n_keep(a, n)
        if a.method.observes and n_keep < n:
            user_call(a, "check", a.method.check, a, n, n_keep)
            user_call(a, "prepare", a.method.prepare, model, a)
            observers.append((a, n_keep))
    captured: dict[int, torch.Tensor] = {}
    observed: dict[str, list[Any]] = {a.name: [None] * len(attns) for a, _ in observers}
    handles = []
    w = min(query_window, n)
    if w > 0:

        def make_hook(idx: int, attn: torch.nn.Module) -> Callable:
            rotary = _rotary_fn(attn)

            def hook(module, args, kwargs):
                hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                cos, sin = kwargs["position_embeddings"]
                h = hidden[:, -w:]
                q = module.q_proj(h).view(1, w, -1, module.head_dim)
                if hasattr(module, "q_norm"):
                    q = module.q_norm(q)
                q = q.transpose(1, 2)
                q, _ = rotary(q, q, cos[:, -w:], sin[:, -w:])
                captured[idx] = q[0]

            return hook

        for i, attn in enumerate(attns):
            handles.append(attn.register_forward_pre_hook(make_hook(i, attn), with_kwargs=True))
    if observers:

        def make_observer(idx: int) -> Callable:
            def hook(module, args, kwargs, output):
                hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                cache = kwargs["past_key_values"].layers[module.layer_idx]
                attentions = output[1] if isinstance(output, tuple) and len(output) > 1 else None
                inputs = LayerInputs(
                    idx, module, hidden, cache.keys, cache.values, attentions, kwargs
                )
                shared = [cache.keys, cache.values, *kwargs.get("position_embeddings", ())]
                before = [_tensor_digest(t) for t in shared]
                for action, n_keep in observers:
                    method = action.method
                    found = user_call(action, "observe", method.observe, action, inputs, n_keep)
                    after = [_tensor_digest(t) for t in shared]
                    if not all(map(torch.equal, before, after)):
                        raise ActionError(
                            f"action {action.name!r}: observe changed layer {idx}'s keys, "
                            "values or position embeddings during the prefill; a selector "
                            "must not modify what the model and every other action read"
                        )
                    observed[action.name][idx] = found

            return hook

        for i, attn in enumerate(attns):
            handles.append(attn.register_forward_hook(make_observer(i), with_kwargs=True))
    try:
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    cache = out.past_key_values
    keys = [layer.keys[0] for layer in cache.layers]
    values = [layer.values[0] for layer in cache.layers]
    return Prefill(
        keys=keys,
        values=values,
        window_queries=[captured[i] for i in range(len(attns))] if w > 0 else [],
        last_logits=out.logits[0, -1],
        n=n,
        num_key_value_groups=attns[0].num_key_value_groups,
        head_dim=attns[0].head_dim,
        observed=observed,
    )


def _all_positions(prefill: Prefill, n: int) -> torch.Tensor:
    import torch

    n_layers, n_kv = len(prefill.keys), prefill.keys[0].shape[0]
    return torch.arange(n, device=prefill.keys[0].device).expand(n_layers, n_kv, n).clone()


def kept_counts(kept: torch.Tensor) -> torch.Tensor:
    """Entries kept per layer and KV head (L, H_kv) of a kept-position tensor (−1 pads)."""
    return (kept >= 0).sum(dim=-1)


def select_positions(prefill: Prefill, action: ActionSpec | Mapping[str, Any]) -> torch.Tensor:
    """Kept prompt positions (L, H_kv, n_keep), ascending per head, from a prefill (ragged
    selectors: padded at the end with −1).

    The selector's output is checked against the contract before anything decodes it, and the
    prefill is shown unchanged by the selector (:mod:`kvdiverge.eviction.contract`); each
    violation, and any exception of the selector's own code, is one :class:`ActionError` line
    naming the action and the selector."""
    action = _as_action(action)
    n = prefill.n
    n_keep = checked_n_keep(action, n)
    if n_keep >= n:
        return _all_positions(prefill, n)
    method = action.method
    user_call(action, "check", method.check, action, n, n_keep)
    if method.observes and action.name not in prefill.observed:
        raise ActionError(
            f"action {action.name!r}: the prefill did not observe this action "
            "(pass it to run_prefill(..., actions=...))"
        )
    before = prefill.verified if prefill.verified is not None else prefill.digest()
    kept = user_call(action, "positions", method.positions, prefill, action, n_keep)
    per_layer = user_call(action, "kept_per_layer", method.kept_per_layer, prefill, action, n_keep)
    prefill.verified = check_unchanged(prefill, before, action, "positions")
    kept = checked_positions(kept, prefill, action, n_keep, per_layer)
    if _first_call(action):
        _check_deterministic(prefill, action, n_keep, kept)
    return kept


_CHECKED: dict[int, object] = {}
"""Selector instances already shown deterministic in this process, by id (the instance is held,
so that its id is never reused)."""


def _first_call(action: ActionSpec) -> bool:
    """Whether this process has not yet checked the action's selector instance for determinism:
    user code only (the package's own selectors, the kvpress bridge among them, are tested to
    be deterministic), and never a seeded random one (``deterministic = False``)."""
    method = action.method
    if type(method).__module__.startswith("kvdiverge."):
        return False
    if not getattr(method, "deterministic", True) or id(method) in _CHECKED:
        return False
    _CHECKED[id(method)] = method
    return True


def _check_deterministic(
    prefill: Prefill, action: ActionSpec, n_keep: int, kept: torch.Tensor
) -> None:
    """The selector's positions computed again from the same prefill must be the same: a
    difference is one :class:`ActionError` line naming the first layer and KV head that differ
    and the way to declare a seeded random method."""
    import torch

    method = action.method
    again = user_call(action, "positions", method.positions, prefill, action, n_keep)
    per_layer = user_call(action, "kept_per_layer", method.kept_per_layer, prefill, action, n_keep)
    prefill.verified = check_unchanged(prefill, prefill.verified, action, "positions")
    again = checked_positions(again, prefill, action, n_keep, per_layer)
    if again.shape == kept.shape and torch.equal(again, kept):
        return
    if again.shape == kept.shape:
        layer, head = (int(i) for i in (again != kept).any(dim=-1).nonzero()[0])
        place = f"first at layer {layer}, KV head {head}"
    else:
        place = f"{tuple(kept.shape)} then {tuple(again.shape)} positions"
    raise ActionError(
        f"action {action.name!r}: {selector_label(action)}: positions returned different kept "
        f"positions when called twice on the same prefill ({place}); expected a deterministic "
        "selector, or a seeded random one that declares deterministic = False and an integer "
        '`seed` parameter (docs/compare.md, "Your own selector")'
    )


def kept_positions(
    model: torch.nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    action: ActionSpec | Mapping[str, Any],
) -> torch.Tensor:
    """The prompt positions an action keeps: LongTensor[n_layers, n_kv_heads, n_keep].

    Runs one prefill of ``input_ids`` (the chat-wrapped prompt) and applies the selector.
    """
    action = _as_action(action)
    prefill = run_prefill(model, input_ids, actions=[action])
    return select_positions(prefill, action)
