"""KV-cache eviction: action specs, budgets, selectors and their registry (SPEC §5, DESIGN §3.6).

An action is a plain config dict such as ``{name: snapkv-half, selector: snapkv, budget: 0.5,
window: 64, kernel: 5}``. Eviction happens once, after the prefill of the prompt: a selector
returns, for every layer and KV head, the prompt positions to keep (sorted ascending). Every
layer and head keeps the same number of entries ``n_keep``:

* a float budget in (0, 1] is a fraction of the tokenized prompt length n, floored in exact
  rational arithmetic (0.9 → ``(9 * n) // 10``, never ``int(n * 0.9)``);
* an integer budget ≥ 1 is absolute (everything is kept when n ≤ budget);
* the ``full`` selector keeps everything.

Selectors follow kvpress 0.5.5 (``../shared/reference/snapkv-kvpress.md``): ``recent`` is
StreamingLLMPress (sinks plus the most recent entries), ``snapkv`` is SnapKVPress (window always
kept and counted inside the budget; scores from the window queries' softmax over all keys,
mean over window queries, zero-padded average pooling, mean over the query heads of a KV group).
A new selector is one small class registered with :func:`register_selector`.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

__all__ = [
    "ActionError",
    "ActionSpec",
    "FullSelector",
    "Prefill",
    "RecentSelector",
    "SELECTORS",
    "Selector",
    "SnapKVSelector",
    "budget_tokens",
    "kept_positions",
    "parse_action",
    "register_selector",
    "run_prefill",
    "select_positions",
    "snapkv_scores",
]


class ActionError(ValueError):
    """An action spec is invalid, or cannot be applied to a prompt; the message is one line."""


@dataclass(frozen=True)
class ActionSpec:
    """An eviction action (DESIGN §3.6): selector name, budget and selector parameters."""

    name: str
    selector: str
    budget: float | int | None = None
    window: int = 64
    kernel: int = 5
    sinks: int = 4
    extra: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """All parameters, for trajectory metadata (DESIGN §3.2)."""
        out = {
            "name": self.name,
            "selector": self.selector,
            "budget": self.budget,
            "window": self.window,
            "kernel": self.kernel,
            "sinks": self.sinks,
        }
        out.update(self.extra)
        return out

    def n_keep(self, n: int) -> int:
        """Entries kept per layer and KV head for a prompt of n tokens (SPEC §5)."""
        if self.selector == "full":
            return n
        return budget_tokens(n, self.budget, where=f"action {self.name!r}")


def _budget_value(budget: Any, where: str) -> int | Fraction:
    """An absolute budget (int ≥ 1) or an exact fraction in (0, 1]; one-line errors."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise ActionError(f"{where}: budget must be a number, got {budget!r}")
    if isinstance(budget, numbers.Integral):
        if budget < 1:
            raise ActionError(f"{where}: an integer budget must be >= 1, got {budget}")
        return int(budget)
    if not math.isfinite(budget) or not (0.0 < budget <= 1.0):
        raise ActionError(
            f"{where}: a float budget is a fraction of n in (0, 1], got {budget!r} "
            "(write an integer for an absolute budget)"
        )
    return Fraction(repr(float(budget)))


def budget_tokens(n: int, budget: float | int, where: str = "budget") -> int:
    """Entries kept for prompt length n (SPEC §5, DESIGN §3.6), exact integer arithmetic.

    Float in (0, 1]: ``floor(budget · n)`` with the budget read as the exact decimal it prints
    as (0.9 → 9/10). Integer ≥ 1: ``min(budget, n)``.
    """
    value = _budget_value(budget, where)
    if isinstance(value, int):
        return min(value, n)
    kept = (value.numerator * n) // value.denominator
    if kept < 1:
        raise ActionError(f"{where}: budget {budget!r} keeps no entry of a {n}-token prompt")
    return kept


def parse_action(spec: Mapping[str, Any], name: str | None = None) -> ActionSpec:
    """Validate an action config dict and return its :class:`ActionSpec` (DESIGN §3.6).

    Errors are one line naming the action and the field.
    """
    name = str(spec.get("name", name) if name is None else name)
    where = f"actions.{name}"
    selector = spec.get("selector")
    if selector not in SELECTORS:
        raise ActionError(
            f"{where}.selector: expected one of {', '.join(sorted(SELECTORS))}, got {selector!r}"
        )
    known = {"name", "selector", "budget", "window", "kernel", "sinks"}
    extra = {k: v for k, v in spec.items() if k not in known}
    action = ActionSpec(
        name=name,
        selector=selector,
        budget=spec.get("budget"),
        window=int(spec.get("window", 64)),
        kernel=int(spec.get("kernel", 5)),
        sinks=int(spec.get("sinks", 4)),
        extra=extra,
    )
    SELECTORS[selector].validate(action, where)
    return action


def _as_action(action: ActionSpec | Mapping[str, Any]) -> ActionSpec:
    return action if isinstance(action, ActionSpec) else parse_action(action)


@dataclass
class Prefill:
    """The prompt's full KV cache and what selectors need from the prefill (DESIGN §4).

    ``keys[l]``/``values[l]``: (H_kv, n, d), keys post-RoPE. ``window_queries[l]``: (H, w, d)
    post-RoPE queries of the last w prompt positions (empty list when no selector needs them).
    ``last_logits``: (V,) next-token logits after the prompt (the first generated token's law,
    shared by the reference and every intervention, so δ_1 = 0).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    window_queries: list[torch.Tensor]
    last_logits: torch.Tensor
    n: int
    num_key_value_groups: int
    head_dim: int


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


@torch.no_grad()
def run_prefill(
    model: torch.nn.Module, input_ids: Sequence[int] | torch.Tensor, query_window: int = 0
) -> Prefill:
    """One prefill of the prompt (DESIGN §4): full cache, last logits, window queries.

    ``query_window`` > 0 also records the post-RoPE queries of the last ``query_window``
    positions of every layer (SnapKV's observation window), computed from the layer's input
    exactly as kvpress does (q_proj with bias, q_norm when the model has one, RoPE).
    """
    device = next(model.parameters()).device
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device).reshape(1, -1)
    n = ids.shape[1]
    attns = _attention_modules(model)
    captured: dict[int, torch.Tensor] = {}
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
    )


class Selector:
    """Base class of eviction selectors (DESIGN §3.6). Subclass, set ``name``, register.

    ``query_window(action)`` says how many window queries the prefill must record;
    ``validate`` checks the spec once (config time); ``check`` checks it against a prompt;
    ``positions`` returns kept positions (L, H_kv, n_keep), only called when n_keep < n.
    """

    name: ClassVar[str]

    def query_window(self, action: ActionSpec) -> int:
        """Window queries the prefill must record for this action (0: none)."""
        return 0

    def validate(self, action: ActionSpec, where: str) -> None:
        """Check the spec's fields once (config time); one-line :class:`ActionError`."""
        _check_budget_field(action, where)

    def check(self, action: ActionSpec, n: int, n_keep: int) -> None:
        """Check the action against an n-token prompt that keeps n_keep < n entries."""
        return None

    def positions(self, prefill: Prefill, action: ActionSpec, n_keep: int) -> torch.Tensor:
        """Kept positions (L, H_kv, n_keep), ascending per head (DESIGN §3.6)."""
        raise NotImplementedError


def _check_budget_field(action: ActionSpec, where: str) -> None:
    if action.budget is None:
        raise ActionError(f"{where}.budget: required for selector {action.selector!r}")
    _budget_value(action.budget, f"{where}.budget")


SELECTORS: dict[str, Selector] = {}


def register_selector(cls: type[Selector]) -> type[Selector]:
    """Class decorator: add a selector to the registry under ``cls.name``."""
    SELECTORS[cls.name] = cls()
    return cls


def _check_always_kept(action: ActionSpec, n: int, n_keep: int, count: int, what: str) -> None:
    """The prompt (n tokens) and the budget (n_keep) must leave room for ``count`` positions the
    selector always keeps (``what``, e.g. the sinks): a clear error, never silent nonsense."""
    if n <= count:
        raise ActionError(f"action {action.name!r}: prompt of {n} tokens is too short for {what}")
    if n_keep < count:
        raise ActionError(
            f"action {action.name!r}: budget keeps {n_keep} entries of a {n}-token prompt, "
            f"fewer than {what}"
        )


@register_selector
class FullSelector(Selector):
    """Full retention: the control action, keeps every prompt entry (SPEC §5: δ ≡ 0)."""

    name = "full"

    def validate(self, action: ActionSpec, where: str) -> None:
        if action.budget is not None and action.budget != 1.0:
            raise ActionError(f"{where}.budget: selector 'full' keeps everything; omit budget")

    def positions(self, prefill: Prefill, action: ActionSpec, n_keep: int) -> torch.Tensor:
        return _all_positions(prefill, prefill.n)


@register_selector
class RecentSelector(Selector):
    """StreamingLLM: ``sinks`` first positions plus the most recent remaining ones (SPEC §5)."""

    name = "recent"

    def validate(self, action: ActionSpec, where: str) -> None:
        _check_budget_field(action, where)
        if action.sinks < 0:
            raise ActionError(f"{where}.sinks: expected an integer >= 0, got {action.sinks}")
        if isinstance(action.budget, int) and action.budget < action.sinks:
            raise ActionError(
                f"{where}.budget: {action.budget} is below the {action.sinks} sink positions"
            )

    def check(self, action: ActionSpec, n: int, n_keep: int) -> None:
        _check_always_kept(action, n, n_keep, action.sinks, f"the {action.sinks} sink positions")

    def positions(self, prefill: Prefill, action: ActionSpec, n_keep: int) -> torch.Tensor:
        n, s = prefill.n, action.sinks
        device = prefill.keys[0].device
        keep = torch.cat(
            [torch.arange(s, device=device), torch.arange(n - (n_keep - s), n, device=device)]
        )
        n_layers, n_kv = len(prefill.keys), prefill.keys[0].shape[0]
        return keep.expand(n_layers, n_kv, n_keep).clone()


def snapkv_scores(
    window_queries: torch.Tensor, keys: torch.Tensor, window: int, kernel: int, groups: int
) -> torch.Tensor:
    """SnapKV prefix scores of one layer, as kvpress's ``SnapKVPress.score``: (H_kv, n − w).

    ``window_queries`` (H, ≥w, d) post-RoPE, ``keys`` (H_kv, n, d) post-RoPE, in the model's
    dtype. The arithmetic follows kvpress step by step and in its dtypes, so that the kept sets
    agree also in bfloat16 (``docs/method.md``, "SnapKV"): logits q·kᵀ/√d in the model's dtype,
    causal mask inside the window, softmax over all n keys in float32 cast back to the model's
    dtype, prefix columns kept without renormalising, then in the model's dtype the mean over
    the w queries, zero-padded average pooling (kernel k, stride 1) and the mean over the
    query heads of each KV group.
    """
    q = window_queries[:, -window:]
    n_heads, w, d = q.shape
    n = keys.shape[1]
    k = keys.to(q.dtype).repeat_interleave(groups, dim=0)  # (H, n, d), repeat_kv layout
    logits = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(d)
    pos_q = torch.arange(n - w, n, device=q.device)[:, None]
    pos_k = torch.arange(n, device=q.device)[None, :]
    logits = logits.masked_fill(pos_k > pos_q, float("-inf"))
    probs = logits.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    prefix = probs[..., : n - w].mean(dim=1)  # (H, n − w)
    pooled = F.avg_pool1d(prefix[:, None, :], kernel, stride=1, padding=kernel // 2)[:, 0]
    return pooled.view(n_heads // groups, groups, -1).mean(dim=1)


@register_selector
class SnapKVSelector(Selector):
    """SnapKV as kvpress's SnapKVPress (SPEC §5): window kept, top prefix scores fill the rest."""

    name = "snapkv"

    def query_window(self, action: ActionSpec) -> int:
        return action.window

    def validate(self, action: ActionSpec, where: str) -> None:
        _check_budget_field(action, where)
        if action.window < 1:
            raise ActionError(f"{where}.window: expected an integer >= 1, got {action.window}")
        if action.kernel < 1 or action.kernel % 2 == 0:
            raise ActionError(f"{where}.kernel: expected an odd integer >= 1, got {action.kernel}")
        if isinstance(action.budget, int) and action.budget < action.window:
            raise ActionError(
                f"{where}.budget: {action.budget} is below the observation window "
                f"{action.window} (the window is always kept)"
            )

    def check(self, action: ActionSpec, n: int, n_keep: int) -> None:
        what = f"the {action.window}-token observation window"
        _check_always_kept(action, n, n_keep, action.window, what)

    def positions(self, prefill: Prefill, action: ActionSpec, n_keep: int) -> torch.Tensor:
        w = action.window
        if not prefill.window_queries or prefill.window_queries[0].shape[1] < w:
            raise ActionError(f"action {action.name!r}: prefill did not record {w} window queries")
        out = []
        for q, k in zip(prefill.window_queries, prefill.keys, strict=True):
            scores = snapkv_scores(q, k, w, action.kernel, prefill.num_key_value_groups)
            # as kvpress: the window padded above the layer's largest score, top n_keep of all n
            padded = F.pad(scores, (0, w), value=scores.max().item() + 1)
            out.append(padded.topk(n_keep, dim=-1).indices.sort(dim=-1).values)
        return torch.stack(out)


def _all_positions(prefill: Prefill, n: int) -> torch.Tensor:
    n_layers, n_kv = len(prefill.keys), prefill.keys[0].shape[0]
    return torch.arange(n, device=prefill.keys[0].device).expand(n_layers, n_kv, n).clone()


def select_positions(prefill: Prefill, action: ActionSpec | Mapping[str, Any]) -> torch.Tensor:
    """Kept prompt positions (L, H_kv, n_keep), ascending per head, from a prefill (§3.6)."""
    action = _as_action(action)
    selector = SELECTORS[action.selector]
    n = prefill.n
    n_keep = action.n_keep(n)
    if n_keep >= n:
        return _all_positions(prefill, n)
    selector.check(action, n, n_keep)
    return selector.positions(prefill, action, n_keep)


def kept_positions(
    model: torch.nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    action: ActionSpec | Mapping[str, Any],
) -> torch.Tensor:
    """The prompt positions an action keeps: LongTensor[n_layers, n_kv_heads, n_keep] (§3.6).

    Runs one prefill of ``input_ids`` (the chat-wrapped prompt) and applies the selector.
    """
    action = _as_action(action)
    prefill = run_prefill(model, input_ids, SELECTORS[action.selector].query_window(action))
    return select_positions(prefill, action)
