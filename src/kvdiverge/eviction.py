"""KV-cache eviction: actions, budgets, selectors and their registry.

An action is (name, selector, budget, the selector's parameters), written in the config as one
dict such as ``{selector: snapkv, budget: 0.5, window: 64, kernel: 5}``. Eviction happens once,
after the prefill of the prompt: the action's selector returns, for every layer and KV head, the
prompt positions to keep (ascending). The budget gives ``n_keep`` for an n-token prompt:

* a float budget in (0, 1] is a fraction of n, floored in exact rational arithmetic
  (0.9 → ``(9 * n) // 10``, never ``int(n * 0.9)``);
* an integer budget ≥ 1 is absolute (everything is kept when n ≤ budget);
* a selector that keeps everything (``full``, the control) takes no budget.

A selector is a class whose fields are its parameters, as kvpress's presses are dataclasses
whose fields are theirs: it declares them with their defaults, checks them (:meth:`validate`),
and each action holds its own instance (:attr:`ActionSpec.method`). Most selectors score
positions: :class:`ScoredSelector` turns per-layer, per-KV-head scores into kept positions (the
positions it always keeps, then the top-scored rest up to ``n_keep``, sorted). ``recent``
(kvpress's StreamingLLMPress: sinks plus the most recent entries) and ``snapkv`` (kvpress's
SnapKVPress, ``docs/method.md``, "SnapKV") are short classes on it; ``full`` keeps everything.
``kvpress`` runs a kvpress press's own ``score`` inside the project's prefill
(:mod:`kvdiverge.kvpress_bridge`), and ``selector: "package.module:Class"`` imports a
:class:`Selector` subclass of the user's own.

A selector may return ragged kept sets (counts that vary by layer or KV head, e.g. kvpress's
PyramidKV and AdaKV): each head's positions ascending, padded at the end with −1 to the
longest head.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar

if typing.TYPE_CHECKING:  # torch is imported where it runs: parsing a config does not load it
    import torch

__all__ = [
    "ActionError",
    "ActionSpec",
    "FullSelector",
    "LayerInputs",
    "Prefill",
    "RecentSelector",
    "SELECTORS",
    "ScoredSelector",
    "Selector",
    "SnapKVSelector",
    "budget_tokens",
    "kept_counts",
    "kept_positions",
    "parse_action",
    "register_selector",
    "resolve_selector",
    "run_prefill",
    "select_positions",
    "snapkv_scores",
]


class ActionError(ValueError):
    """An action spec is invalid, or cannot be applied to a prompt; the message is one line."""


# ---- budgets ------------------------------------------------------------------------------------
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
    """Entries kept for prompt length n, in exact integer arithmetic.

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
    query_window = max([query_window, *(a.method.query_window(a) for a in specs)])
    attns = _attention_modules(model)
    observers: list[tuple[ActionSpec, int]] = []
    for a in specs:
        n_keep = a.n_keep(n)
        if a.method.observes and n_keep < n:
            a.method.check(a, n, n_keep)
            a.method.prepare(model, a)
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
                for action, n_keep in observers:
                    observed[action.name][idx] = action.method.observe(action, inputs, n_keep)

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


# ---- selectors ----------------------------------------------------------------------------------
class Selector:
    """Base class of eviction selectors.

    A subclass declares its parameters as dataclass fields with their defaults (decorate it with
    ``@dataclass(frozen=True)``); each action holds its own instance, built from the action's
    parameters and checked by :meth:`validate`. It returns kept positions from :meth:`positions`
    (or, on :class:`ScoredSelector`, scores from ``score``). Register it under ``name`` with
    :func:`register_selector`, or name it in a config as ``"package.module:Class"``.

    ``keeps_everything``: the selector keeps every entry whatever the budget (the control);
    ``observes``: it sees every attention layer during the prefill (:meth:`observe`).
    """

    name: ClassVar[str] = ""
    keeps_everything: ClassVar[bool] = False
    observes: ClassVar[bool] = False

    def validate(self, action: ActionSpec, where: str) -> None:
        """Check the parameters once (config time); one-line :class:`ActionError` naming
        ``where``.<field>. The base checks that a budget is given and is valid."""
        _check_budget_field(action, where)

    def n_keep(self, action: ActionSpec, n: int) -> int:
        """Entries kept per layer and KV head (on average, for ragged selectors) of an n-token
        prompt."""
        return budget_tokens(n, action.budget, where=f"action {action.name!r}")

    def query_window(self, action: ActionSpec) -> int:
        """Window queries the prefill must record for this action (0: none)."""
        return 0

    def check(self, action: ActionSpec, n: int, n_keep: int) -> None:
        """Check the action against an n-token prompt that keeps n_keep < n entries."""
        return None

    def prepare(self, model: torch.nn.Module, action: ActionSpec) -> None:
        """Called once before a prefill that this action observes (``observes``)."""
        return None

    def observe(self, action: ActionSpec, layer: LayerInputs, n_keep: int) -> Any:
        """What to keep from one attention layer of the prefill (``observes``): stored in
        ``prefill.observed[action.name][layer.layer]``."""
        return None

    def positions(self, prefill: Prefill, action: ActionSpec, n_keep: int) -> torch.Tensor:
        """Kept positions (L, H_kv, n_keep), ascending per head; only called when n_keep < n.
        Ragged sets: (L, H_kv, m), each head ascending and padded at the end with −1."""
        raise NotImplementedError


class ScoredSelector(Selector):
    """A selector that scores every prompt position per layer and KV head.

    :meth:`score` gives (H_kv, n) scores for a layer (higher is kept); :meth:`always_kept` the
    positions kept whatever their scores. Kept positions: the always-kept ones, then the
    top-scored rest up to ``n_keep`` (torch's ``topk``), sorted. As in kvpress, the always-kept
    positions are scored one above the layer's largest other score, so one ``topk`` of
    ``n_keep`` over all positions keeps them.
    """

    def always_kept(self, n: int) -> Sequence[int] | torch.Tensor:
        """Positions of an n-token prompt kept whatever their scores (default: none)."""
        return ()

    def score(self, prefill: Prefill, action: ActionSpec, layer: int) -> torch.Tensor:
        """Scores (H_kv, n) of layer ``layer``'s prompt positions; higher is kept."""
        raise NotImplementedError

    def positions(self, prefill: Prefill, action: ActionSpec, n_keep: int) -> torch.Tensor:
        import torch

        n = prefill.n
        device = prefill.keys[0].device
        always = torch.as_tensor(self.always_kept(n), dtype=torch.long, device=device)
        rest = torch.ones(n, dtype=torch.bool, device=device)
        rest[always] = False
        out = []
        for layer in range(len(prefill.keys)):
            scores = self.score(prefill, action, layer)
            if always.numel():
                top = scores[:, rest].max().item() + 1 if bool(rest.any()) else 1.0
                scores = scores.clone()
                scores[:, always] = top
            out.append(scores.topk(n_keep, dim=-1).indices.sort(dim=-1).values)
        return torch.stack(out)


def _check_budget_field(action: ActionSpec, where: str) -> None:
    if action.budget is None:
        raise ActionError(f"{where}.budget: required for selector {action.selector!r}")
    _budget_value(action.budget, f"{where}.budget")


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


class _Registered:
    """``SELECTORS[name]``: a registered selector class. Its methods, called with an action, run
    on that action's own selector instance (which carries the action's parameters)."""

    def __init__(self, cls: type[Selector], name: str | None = None) -> None:
        self.cls = cls
        self.name = cls.name if name is None else name

    def __repr__(self) -> str:
        return f"SELECTORS[{self.name!r}] -> {self.cls.__module__}.{self.cls.__qualname__}"

    def validate(self, action: ActionSpec, where: str) -> None:
        action.method.validate(action, where)

    def query_window(self, action: ActionSpec) -> int:
        return action.method.query_window(action)

    def check(self, action: ActionSpec, n: int, n_keep: int) -> None:
        action.method.check(action, n, n_keep)

    def positions(self, prefill: Prefill, action: ActionSpec, n_keep: int) -> torch.Tensor:
        return action.method.positions(prefill, action, n_keep)


SELECTORS: dict[str, _Registered] = {}


def register_selector(cls: type[Selector]) -> type[Selector]:
    """Class decorator: add a selector class to the registry under ``cls.name``."""
    SELECTORS[cls.name] = _Registered(cls)
    return cls


def resolve_selector(selector: Any, where: str = "selector") -> type[Selector]:
    """The selector class for a config's ``selector``: a registered name, or
    ``"package.module:Class"`` (imported, checked to be a :class:`Selector` subclass and
    registered under that string). One-line :class:`ActionError` otherwise."""
    if isinstance(selector, str) and selector in SELECTORS:
        return SELECTORS[selector].cls
    if not isinstance(selector, str) or ":" not in selector:
        names = ", ".join(sorted(s for s in SELECTORS if s != "kvpress" and ":" not in s))
        raise ActionError(
            f"{where}: expected one of {names}, got {selector!r} (or kvpress with a `press`, or "
            "'package.module:Class' naming a Selector subclass of your own)"
        )
    module_name, _, class_name = selector.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import error of any kind, in one line
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ActionError(f"{where}: cannot import module {module_name!r} ({reason})") from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Selector)):
        what = "no attribute" if cls is None else f"{type(cls).__name__} {cls!r}, not a class"
        if isinstance(cls, type):
            what = f"class {class_name}, not a subclass of kvdiverge.eviction.Selector"
        raise ActionError(f"{where}: {selector!r} is {what}; expected a Selector subclass")
    SELECTORS[selector] = _Registered(cls, selector)
    return cls


def _parameter_fields(cls: type[Selector]) -> dict[str, dataclasses.Field]:
    if not dataclasses.is_dataclass(cls):
        return {}
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _check_parameter_types(cls: type[Selector], params: Mapping[str, Any], where: str) -> None:
    """int, float, bool, str and mapping fields: the value's kind (no ``4.0`` for an int, no
    ``true`` for a number); other annotations are left to the selector's :meth:`validate`."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # annotations that do not resolve: nothing to check here
        return
    for key, value in params.items():
        hint = hints.get(key)
        origin = typing.get_origin(hint) or hint
        if hint is int:
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            kind = "an integer"
        elif hint is float:
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
            kind = "a number"
        elif hint is bool:
            ok, kind = isinstance(value, bool), "true or false"
        elif hint is str:
            ok, kind = isinstance(value, str), "text"
        elif origin in (dict, Mapping):
            ok, kind = isinstance(value, Mapping), "a mapping"
        else:
            continue
        if not ok:
            raise ActionError(f"{where}.{key}: expected {kind}, got {value!r}")


def _build_selector(cls: type[Selector], params: Mapping[str, Any], where: str) -> Selector:
    fields = _parameter_fields(cls)
    unknown = sorted(set(params) - set(fields))
    if unknown:
        known = ", ".join(fields) or "none"
        raise ActionError(
            f"{where}.{unknown[0]}: not a parameter of selector {cls.name or cls.__name__!r} "
            f"(its parameters: {known})"
        )
    _check_parameter_types(cls, params, where)
    try:
        return cls(**params)
    except ActionError:
        raise
    except (TypeError, ValueError) as exc:
        raise ActionError(f"{where}: {' '.join(str(exc).split())}") from exc


@dataclass(frozen=True)
class ActionSpec:
    """An eviction action: its name, selector (a registered name or ``"package.module:Class"``),
    budget, and ``method``, the selector instance that carries the action's parameters (read
    them as ``action.params`` or as attributes, e.g. ``action.window``)."""

    name: str
    selector: str
    budget: float | int | None
    method: Selector

    @property
    def params(self) -> dict[str, Any]:
        """The selector's parameters, defaults included."""
        return {key: getattr(self.method, key) for key in _parameter_fields(type(self.method))}

    def __getattr__(self, key: str) -> Any:
        method = self.__dict__.get("method")
        if method is not None and key in _parameter_fields(type(method)):
            return getattr(method, key)
        raise AttributeError(f"{type(self).__name__} {self.__dict__.get('name')!r} has no {key!r}")

    @property
    def keeps_everything(self) -> bool:
        """Whether the action keeps every entry whatever the prompt (the full-retention
        control)."""
        return self.method.keeps_everything

    def as_dict(self) -> dict[str, Any]:
        """Name, selector, budget and every selector parameter, for trajectory metadata."""
        return {"name": self.name, "selector": self.selector, "budget": self.budget, **self.params}

    def n_keep(self, n: int) -> int:
        """Entries kept per layer and KV head for a prompt of n tokens."""
        return self.method.n_keep(self, n)


def parse_action(spec: Mapping[str, Any], name: str | None = None) -> ActionSpec:
    """Validate an action config dict and return its :class:`ActionSpec`.

    ``selector`` picks the class; ``budget`` the kept count; every other key is a parameter of
    the selector (unknown ones are errors). Errors are one line naming the action and the field.
    """
    name = str(spec.get("name", name) if name is None else name)
    where = f"actions.{name}"
    selector = spec.get("selector")
    cls = resolve_selector(selector, f"{where}.selector")
    params = {k: v for k, v in spec.items() if k not in ("name", "selector", "budget")}
    method = _build_selector(cls, params, where)
    action = ActionSpec(name=name, selector=selector, budget=spec.get("budget"), method=method)
    method.validate(action, where)
    return action


def _as_action(action: ActionSpec | Mapping[str, Any]) -> ActionSpec:
    return action if isinstance(action, ActionSpec) else parse_action(action)


@register_selector
@dataclass(frozen=True)
class FullSelector(Selector):
    """Full retention: the control action, keeps every prompt entry (δ ≡ 0)."""

    name: ClassVar[str] = "full"
    keeps_everything: ClassVar[bool] = True

    def validate(self, action: ActionSpec, where: str) -> None:
        if action.budget is not None and action.budget != 1.0:
            raise ActionError(f"{where}.budget: selector 'full' keeps everything; omit budget")

    def n_keep(self, action: ActionSpec, n: int) -> int:
        return n

    def positions(self, prefill: Prefill, action: ActionSpec, n_keep: int) -> torch.Tensor:
        return _all_positions(prefill, prefill.n)


@register_selector
@dataclass(frozen=True)
class RecentSelector(ScoredSelector):
    """StreamingLLM (kvpress's StreamingLLMPress): the ``sinks`` first positions plus the most
    recent ones."""

    name: ClassVar[str] = "recent"
    sinks: int = 4

    def validate(self, action: ActionSpec, where: str) -> None:
        _check_budget_field(action, where)
        if self.sinks < 0:
            raise ActionError(f"{where}.sinks: expected an integer >= 0, got {self.sinks}")
        if isinstance(action.budget, int) and action.budget < self.sinks:
            raise ActionError(
                f"{where}.budget: {action.budget} is below the {self.sinks} sink positions"
            )

    def check(self, action: ActionSpec, n: int, n_keep: int) -> None:
        _check_always_kept(action, n, n_keep, self.sinks, f"the {self.sinks} sink positions")

    def always_kept(self, n: int) -> range:
        return range(self.sinks)

    def score(self, prefill: Prefill, action: ActionSpec, layer: int) -> torch.Tensor:
        import torch

        n_kv, n = prefill.keys[layer].shape[:2]
        position = torch.arange(n, dtype=torch.float64, device=prefill.keys[layer].device)
        return position.expand(n_kv, n)  # the most recent score highest


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
    import torch
    import torch.nn.functional as F

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
@dataclass(frozen=True)
class SnapKVSelector(ScoredSelector):
    """SnapKV as kvpress's SnapKVPress (``docs/method.md``, "SnapKV"): the ``window`` last
    positions always kept, the top prefix scores fill the rest of the budget."""

    name: ClassVar[str] = "snapkv"
    window: int = 64
    kernel: int = 5

    def validate(self, action: ActionSpec, where: str) -> None:
        _check_budget_field(action, where)
        if self.window < 1:
            raise ActionError(f"{where}.window: expected an integer >= 1, got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ActionError(f"{where}.kernel: expected an odd integer >= 1, got {self.kernel}")
        if isinstance(action.budget, int) and action.budget < self.window:
            raise ActionError(
                f"{where}.budget: {action.budget} is below the observation window "
                f"{self.window} (the window is always kept)"
            )

    def query_window(self, action: ActionSpec) -> int:
        return self.window

    def check(self, action: ActionSpec, n: int, n_keep: int) -> None:
        what = f"the {self.window}-token observation window"
        _check_always_kept(action, n, n_keep, self.window, what)

    def always_kept(self, n: int) -> range:
        return range(n - self.window, n)

    def score(self, prefill: Prefill, action: ActionSpec, layer: int) -> torch.Tensor:
        import torch.nn.functional as F

        w = self.window
        if not prefill.window_queries or prefill.window_queries[0].shape[1] < w:
            raise ActionError(f"action {action.name!r}: prefill did not record {w} window queries")
        q, k = prefill.window_queries[layer], prefill.keys[layer]
        scores = snapkv_scores(q, k, w, self.kernel, prefill.num_key_value_groups)
        return F.pad(scores, (0, w))  # the window's own scores: replaced by the always-kept score


def _all_positions(prefill: Prefill, n: int) -> torch.Tensor:
    import torch

    n_layers, n_kv = len(prefill.keys), prefill.keys[0].shape[0]
    return torch.arange(n, device=prefill.keys[0].device).expand(n_layers, n_kv, n).clone()


def kept_counts(kept: torch.Tensor) -> torch.Tensor:
    """Entries kept per layer and KV head (L, H_kv) of a kept-position tensor (−1 pads)."""
    return (kept >= 0).sum(dim=-1)


def select_positions(prefill: Prefill, action: ActionSpec | Mapping[str, Any]) -> torch.Tensor:
    """Kept prompt positions (L, H_kv, n_keep), ascending per head, from a prefill (ragged
    selectors: padded at the end with −1)."""
    action = _as_action(action)
    n = prefill.n
    n_keep = action.n_keep(n)
    if n_keep >= n:
        return _all_positions(prefill, n)
    action.method.check(action, n, n_keep)
    if action.method.observes and action.name not in prefill.observed:
        raise ActionError(
            f"action {action.name!r}: the prefill did not observe this action "
            "(pass it to run_prefill(..., actions=...))"
        )
    return action.method.positions(prefill, action, n_keep)


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


from kvdiverge import kvpress_bridge as _kvpress_bridge  # noqa: E402,F401  (registers kvpress)
