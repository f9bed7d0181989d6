"""Selectors and actions: the base classes :class:`Selector` and :class:`ScoredSelector`, their
registry (:func:`register_selector`, :func:`resolve_selector`), and :class:`ActionSpec`, an
action's name, budget and selector instance (:func:`parse_action`)."""

from __future__ import annotations

import dataclasses
import importlib
import numbers
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

if typing.TYPE_CHECKING:  # torch is imported where it runs: parsing a config does not load it
    import torch

from kvdiverge.eviction.budgets import ActionError, _budget_value, budget_tokens
from kvdiverge.eviction.contract import check_scores, checked_n_keep, selector_label, user_call

if typing.TYPE_CHECKING:
    from kvdiverge.eviction.prefill import LayerInputs, Prefill


# ---- selectors ----------------------------------------------------------------------------------
class Selector:
    """Base class of eviction selectors.

    A subclass declares its parameters as dataclass fields with their defaults (decorate it with
    ``@dataclass(frozen=True)``); each action holds its own instance, built from the action's
    parameters and checked by :meth:`validate`. It returns kept positions from :meth:`positions`
    (or, on :class:`ScoredSelector`, scores from ``score``). Register it under ``name`` with
    :func:`register_selector`, or name it in a config as ``"package.module:Class"``.

    ``keeps_everything``: the selector keeps every entry whatever the budget (the control);
    ``observes``: it sees every attention layer during the prefill (:meth:`observe`);
    ``deterministic``: the same prefill gives the same kept positions. A user's selector is
    checked on the first prompt a process selects from (:meth:`positions` called twice, a
    difference refused).
    A seeded random method sets ``deterministic = False`` and declares an integer ``seed``
    parameter (refused at parse time without one) from which it draws, so that the seed is
    part of the action's config, lock and metadata.

    A parameter field never takes the name of an action key or attribute (:data:`ACTION_KEYS`:
    ``name``, ``selector``, ``budget``, ``budgets``, ``label``, ...): those are the config's
    alone, refused at parse time.
    """

    name: ClassVar[str] = ""
    keeps_everything: ClassVar[bool] = False
    observes: ClassVar[bool] = False
    deterministic: ClassVar[bool] = True

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
        Ragged sets: (L, H_kv, m), each head ascending and padded at the end with −1.

        Checked before any decoding (:mod:`kvdiverge.eviction.contract`): an integer tensor,
        positions in [0, n), distinct per layer and KV head, exactly ``n_keep`` per head (or the
        ragged counts of :meth:`kept_per_layer`), and the prefill left unchanged: it is shared
        by every action, so copy a tensor before changing it."""
        raise NotImplementedError

    def kept_per_layer(
        self, prefill: Prefill, action: ActionSpec, n_keep: int
    ) -> Sequence[int] | None:
        """A ragged selector's declaration: how many entries each layer keeps over all its KV
        heads, which its :meth:`positions` must return exactly. ``None`` (the default): not
        ragged, every layer and KV head keeps exactly ``n_keep``."""
        return None


class ScoredSelector(Selector):
    """A selector that scores every prompt position per layer and KV head.

    :meth:`score` gives (H_kv, n) scores for a layer (higher is kept); :meth:`always_kept` the
    positions kept whatever their scores. Kept positions: the always-kept ones, then the
    top-scored rest up to ``n_keep`` (torch's ``topk`` over the other positions only), sorted.
    The always-kept positions are kept whatever the scores' size and dtype (:meth:`positions`);
    scoring them one above the layer's largest score instead would round away in low precision
    (``max + 1 == max`` in bfloat16 from 256, float16 from 2048, float32 from 2**24).
    """

    def always_kept(self, n: int) -> Sequence[int] | torch.Tensor:
        """Positions of an n-token prompt kept whatever their scores (default: none)."""
        return ()

    def score(self, prefill: Prefill, action: ActionSpec, layer: int) -> torch.Tensor:
        """Scores (H_kv, n) of layer ``layer``'s prompt positions; higher is kept."""
        raise NotImplementedError

    def positions(self, prefill: Prefill, action: ActionSpec, n_keep: int) -> torch.Tensor:
        """The always-kept positions (a of them) and the ``n_keep`` − a top-scored others of
        each layer and KV head. Floating scores: the always-kept ones are scored +inf, strictly
        above every finite score in every dtype, and one ``topk`` of ``n_keep`` keeps them (its
        ties among the others resolve as kvpress's own ``topk`` does); integer scores: the top
        others are chosen among the other positions alone and joined to them."""
        import torch

        n = prefill.n
        device = prefill.keys[0].device
        n_kv = prefill.keys[0].shape[0]
        listed = user_call(action, "always_kept", self.always_kept, n)
        always = torch.as_tensor(listed, device=device).reshape(-1)
        if always.numel() and not _always_kept_ok(always, n, n_keep):
            raise ActionError(
                f"action {action.name!r}: {selector_label(action)}: always_kept returned "
                f"{always.tolist()[:8]}; expected at most {n_keep} distinct integer positions "
                f"in [0, {n})"
            )
        always = always.long()
        rest = torch.ones(n, dtype=torch.bool, device=device)
        rest[always] = False
        others = rest.nonzero().reshape(-1)  # ascending
        fill = n_keep - always.numel()
        out = []
        for layer in range(len(prefill.keys)):
            scores = user_call(action, "score", self.score, prefill, action, layer)
            check_scores(scores, action, layer, n_kv, n, device)
            scores = scores.to(device)
            if always.numel() and scores.dtype.is_floating_point:
                scores = scores.clone()
                scores[:, always] = float("inf")  # above every finite score, in every dtype
                kept = scores.topk(n_keep, dim=-1).indices
            elif always.numel():  # integer scores: the top others beside the always-kept ones
                picked = others[scores[:, others].topk(fill, dim=-1).indices]
                kept = torch.cat([always.expand(n_kv, -1), picked], dim=-1)
            else:
                kept = scores.topk(n_keep, dim=-1).indices
            out.append(kept.sort(dim=-1).values)
        return torch.stack(out)


def _always_kept_ok(always: torch.Tensor, n: int, n_keep: int) -> bool:
    import torch

    if always.dtype.is_floating_point or always.dtype.is_complex or always.dtype == torch.bool:
        return False
    inside = bool(((always >= 0) & (always < n)).all())
    return inside and always.unique().numel() == always.numel() <= n_keep


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


ACTION_KEYS = ("name", "selector", "budget", "budgets", "label")
"""Keys of a config's action entry that are the action's own, never a selector parameter."""


def _reserved_names() -> tuple[str, ...]:
    """The action keys and every public attribute of :class:`ActionSpec` (``method``,
    ``params``, ``n_keep``, ...): a parameter field of that name would shadow one or be
    shadowed by one."""
    public = [k for k in dir(ActionSpec) if not k.startswith("_")]
    fields = [f.name for f in dataclasses.fields(ActionSpec)]
    return tuple(dict.fromkeys([*ACTION_KEYS, *fields, *public]))


def _check_field_names(cls: type[Selector], selector: Any, where: str) -> None:
    """Action fields are the config's alone: a selector class whose parameter field is named
    like an action key or attribute is refused (one line naming the field), as is a class that
    declares ``deterministic = False`` without an integer ``seed`` parameter."""
    fields = _parameter_fields(cls)
    clash = [name for name in fields if name in _reserved_names()]
    if clash:
        raise ActionError(
            f"{where}.selector: {selector!r} declares a parameter field {clash[0]!r}, which is "
            f"an action key; expected parameter names other than {', '.join(_reserved_names())} "
            "(the action's own fields come from the config alone: rename the field)"
        )
    if not getattr(cls, "deterministic", True):
        try:
            seed_hint = typing.get_type_hints(cls).get("seed")
        except Exception:  # annotations that do not resolve
            seed_hint = None
        if "seed" not in fields or seed_hint is not int:
            raise ActionError(
                f"{where}.selector: {selector!r} declares deterministic = False; expected an "
                "integer `seed` parameter field (seed: int = ...) from which it draws"
            )


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
        """Entries kept per layer and KV head for a prompt of n tokens (the selector's
        :meth:`Selector.n_keep`, checked to be an integer >= 1)."""
        return checked_n_keep(self, n)


def parse_action(spec: Mapping[str, Any], name: str | None = None) -> ActionSpec:
    """Validate an action config dict and return its :class:`ActionSpec`.

    ``selector`` picks the class; ``budget`` the kept count; every other key is a parameter of
    the selector (unknown ones are errors). Errors are one line naming the action and the field.
    """
    name = str(spec.get("name", name) if name is None else name)
    where = f"actions.{name}"
    selector = spec.get("selector")
    cls = resolve_selector(selector, f"{where}.selector")
    _check_field_names(cls, selector, where)
    params = {k: v for k, v in spec.items() if k not in ("name", "selector", "budget")}
    method = _build_selector(cls, params, where)
    action = ActionSpec(name=name, selector=selector, budget=spec.get("budget"), method=method)
    try:
        method.validate(action, where)
    except ActionError:
        raise
    except Exception as exc:  # the selector's own code, in one line (traceback chained)
        text = " ".join(str(exc).split())
        reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        raise ActionError(f"{where}: selector {selector!r}: validate raised {reason}") from exc
    return action


DISPLAY_KEYS = ("label",)
"""Keys of a config's action entry that are no selector parameter (``label``: what figures and
tables show, :mod:`kvdiverge.config.actions`)."""


def selector_entry(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A config's action entry without its :data:`DISPLAY_KEYS`: what :func:`parse_action`
    reads (selector, budget and the selector's parameters)."""
    return {k: v for k, v in spec.items() if k not in DISPLAY_KEYS}


def _as_action(action: ActionSpec | Mapping[str, Any]) -> ActionSpec:
    return action if isinstance(action, ActionSpec) else parse_action(action)


def keeps_everything(action: Any) -> bool:
    """Whether a parsed action keeps every entry whatever the prompt (the full-retention
    control)."""
    flag = getattr(action, "keeps_everything", None)
    return bool(flag) if flag is not None else action.selector == "full"


def check_action(action: Any, n: int, n_keep: int) -> None:
    """The action's selector's own check of an n-token prompt keeping n_keep < n entries
    (:class:`kvdiverge.eviction.ActionError` when it cannot act on it)."""
    method = getattr(action, "method", None)
    if method is None:
        SELECTORS[action.selector].check(action, n, n_keep)
    else:
        user_call(action, "check", method.check, action, n, n_keep)
