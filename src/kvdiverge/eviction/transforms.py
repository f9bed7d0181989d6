"""Prompt transformations: actions whose prompt cache is tensors of their own, not a kept subset
of the prefill's entries, and the bytes every action's cache holds.

A prompt selection (every :class:`~kvdiverge.eviction.Selector`) keeps some of the prompt's own
KV entries. A :class:`PromptTransform` instead returns, per layer, keys and values of its own
computed from the prefill's: quantized-then-dequantized entries
(:mod:`kvdiverge.eviction.quantize`), and later merged, re-rotated or channel-pruned ones. The
engine attends to them exactly as to a gathered kept set (``docs/engine.md``, "Prompt
transformations"), so the coupling, the common random numbers, the full control and every
estimand are unchanged: only the intervention's law Q comes from another cache.

The interface is one method, :meth:`PromptTransform.transform_layer`: given one layer's keys
and values (H_kv, n, d) (keys post-RoPE, as the prefill holds them) and their prompt positions
(H_kv, n), return that layer's keys and values (H_kv, m, d), m >= 1 entries per KV head in the
prefill's dtype and on its device. :func:`transformed_prefix` calls it for every layer, checks
what it returns (one :class:`ActionError` line naming the action, the layer and what was
expected) and shows the prefill unchanged afterwards, before anything decodes; a user's
transformation is also called twice on the first prompt of a process, and different tensors
are refused (a seeded random one declares ``deterministic = False``, as a selector does).

Bytes (:func:`prompt_bytes`, :func:`cache_bytes`): what each action's cache holds per layer, at
the start of the horizon (the prompt part) and at its end (plus the H − 1 generated entries a
row holds at step H, each kept in the model's dtype unless the action quantizes them as they
age: ``selector: quantize`` with ``generated: true``, :mod:`kvdiverge.eviction.quantize`).
A kept subset holds its kept entries × 2 (keys and values) × head size × the dtype's bytes; a
transformation states its own bytes (:meth:`PromptTransform.layer_bytes`).
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kvdiverge.eviction.budgets import ActionError
from kvdiverge.eviction.contract import WholePrompt, check_unchanged, selector_label, user_call
from kvdiverge.eviction.selectors import Selector

if typing.TYPE_CHECKING:  # torch is imported where it runs: parsing a config does not load it
    import torch

    from kvdiverge.eviction.prefill import Prefill
    from kvdiverge.eviction.selectors import ActionSpec

__all__ = [
    "PromptTransform",
    "cache_bytes",
    "is_transform",
    "prompt_bytes",
    "transformed_prefix",
]


class PromptTransform(WholePrompt, Selector):
    """Base class of prompt transformations (module docstring).

    It keeps every prompt position (its kept set is the whole prompt, so the selection step is
    the identity) and takes no ``budget``, refused in one line
    (:class:`~kvdiverge.eviction.contract.WholePrompt`): what it saves is counted in bytes
    (:meth:`layer_bytes`), not in entries. Subclasses declare their parameters as dataclass
    fields, as selectors do, and implement :meth:`transform_layer` and :meth:`layer_bytes`.
    """

    transforms: ClassVar[bool] = True
    acts_on: ClassVar[str] = "transforms the whole prompt cache"
    sized_by: ClassVar[str] = "its memory is counted in bytes"

    def check_shape(self, action: ActionSpec, n: int, n_kv: int, head_dim: int) -> None:
        """Refuse, in one :class:`ActionError` line, a prompt of ``n`` tokens or a model shape
        (KV heads, head size) the transformation cannot act on; called before the first layer
        is transformed (default: every shape is accepted)."""
        return None

    def transform_layer(
        self,
        action: ActionSpec,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s transformed (keys, values), each (H_kv, m, d), from its prefill
        keys and values (H_kv, n, d) and their prompt positions (H_kv, n). Must not modify its
        inputs (they are the prefill every action and the reference read)."""
        raise NotImplementedError

    def layer_bytes(
        self, action: ActionSpec, n: int, n_kv: int, head_dim: int, itemsize: int
    ) -> int:
        """Bytes the transformed prompt cache of one layer holds for an n-token prompt with
        ``n_kv`` KV heads of size ``head_dim`` in a dtype of ``itemsize`` bytes."""
        raise NotImplementedError


def is_transform(action: Any) -> bool:
    """Whether a parsed action is a prompt transformation (:class:`PromptTransform`)."""
    return bool(getattr(getattr(action, "method", None), "transforms", False))


def _where(action: ActionSpec, layer: int) -> str:
    return f"action {action.name!r}: {selector_label(action)}: transform_layer of layer {layer}"


def _checked_part(
    part: Any, action: ActionSpec, layer: int, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's transformed (keys, values) against the contract (module docstring)."""
    import torch

    where = _where(action, layer)
    if not (isinstance(part, tuple | list) and len(part) == 2):
        raise ActionError(f"{where} returned {type(part).__name__}; expected (keys, values)")
    n_kv, _, d = keys.shape
    out = []
    for name, t in zip(("keys", "values"), part, strict=True):
        if not isinstance(t, torch.Tensor):
            raise ActionError(f"{where}: {name} is {type(t).__name__}; expected a torch tensor")
        if t.dim() != 3 or t.shape[0] != n_kv or t.shape[2] != d or t.shape[1] < 1:
            raise ActionError(
                f"{where}: {name} of shape {tuple(t.shape)}; expected ({n_kv}, m, {d}) with "
                "m >= 1 entries per KV head"
            )
        if t.dtype != keys.dtype or t.device != keys.device:
            raise ActionError(
                f"{where}: {name} is {t.dtype} on {t.device}; expected the prefill's "
                f"{keys.dtype} on {keys.device}"
            )
        if not bool(torch.isfinite(t).all()):
            raise ActionError(f"{where}: {name} holds NaN or infinite values; expected finite")
        out.append(t)
    if out[0].shape != out[1].shape:
        raise ActionError(
            f"{where}: keys {tuple(out[0].shape)} and values {tuple(out[1].shape)}; expected "
            "the same number of entries"
        )
    return out[0].contiguous(), out[1].contiguous()


def transformed_prefix(
    prefill: Prefill, action: ActionSpec
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's transformed prompt cache (keys, values), (H_kv, m_l, d), for the engine's
    gathered layout: the transformation's output checked layer by layer, and the prefill shown
    unchanged afterwards (:func:`kvdiverge.eviction.contract.check_unchanged`)."""
    import torch

    method = action.method
    keys0 = prefill.keys[0]
    n_kv, n, d = keys0.shape
    user_call(action, "check_shape", method.check_shape, action, n, n_kv, d)
    before = prefill.verified if prefill.verified is not None else prefill.digest()
    positions = torch.arange(n, device=keys0.device).expand(n_kv, n)
    out = []
    for layer, (keys, values) in enumerate(zip(prefill.keys, prefill.values, strict=True)):
        fn = method.transform_layer
        part = user_call(action, "transform_layer", fn, action, layer, keys, values, positions)
        out.append(_checked_part(part, action, layer, keys))
    prefill.verified = check_unchanged(prefill, before, action, "transform_layer")
    from kvdiverge.eviction.run import _first_call

    if _first_call(action):  # a user's transformation, once per process: the same tensors again
        for layer, (keys, values) in enumerate(zip(prefill.keys, prefill.values, strict=True)):
            fn = method.transform_layer
            again = user_call(action, "transform_layer", fn, action, layer, keys, values, positions)
            again = _checked_part(again, action, layer, keys)
            if not all(torch.equal(a, b) for a, b in zip(again, out[layer], strict=True)):
                raise ActionError(
                    f"{_where(action, layer)} returned different tensors when called twice on "
                    "the same prefill; expected a deterministic transformation, or a seeded "
                    "random one that declares deterministic = False and an integer `seed` "
                    'parameter (docs/compare.md, "Your own selector")'
                )
        prefill.verified = check_unchanged(prefill, prefill.verified, action, "transform_layer")
    return out


@dataclass(frozen=True)
class CacheBytes:
    """Bytes an action's cache holds per layer: ``start`` (the prompt part, what every row
    attends to at step 1) and ``end`` (at step H: the prompt part and a row's H − 1 generated
    entries in the model's dtype)."""

    start: list[int]
    end: list[int]

    def as_dict(self) -> dict[str, Any]:
        return {"start": list(self.start), "end": list(self.end)}


def prompt_bytes(
    action: ActionSpec,
    kept_counts: Sequence[Sequence[int]] | None,
    n: int,
    n_kv: int,
    head_dim: int,
    itemsize: int,
    layers: int,
) -> list[int]:
    """Bytes of each layer's prompt cache: a transformation's :meth:`PromptTransform.layer_bytes`;
    a kept subset's Σ_heads kept entries × 2 × ``head_dim`` × ``itemsize`` (``kept_counts``:
    (layers, KV heads) entries kept, :func:`kvdiverge.eviction.kept_counts`)."""
    if is_transform(action):
        size = user_call(
            action, "layer_bytes", action.method.layer_bytes, action, n, n_kv, head_dim, itemsize
        )
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ActionError(
                f"action {action.name!r}: {selector_label(action)}: layer_bytes returned "
                f"{size!r}; expected an integer >= 0"
            )
        return [size] * layers
    if kept_counts is None:
        raise ValueError("prompt_bytes: a kept subset needs its kept counts")
    return [sum(int(c) for c in heads) * 2 * head_dim * itemsize for heads in kept_counts]


def cache_bytes(
    prompt: Sequence[int],
    H: int,
    n_kv: int,
    head_dim: int,
    itemsize: int,
    generated: int | None = None,
) -> CacheBytes:
    """Per-layer bytes at the start and the end of an H-step horizon: the prompt part, then the
    prompt part plus the H − 1 generated entries (keys and values of ``n_kv`` heads of size
    ``head_dim`` in ``itemsize``-byte elements) a row holds at step H; ``generated``: those
    entries' bytes per layer where the action stores them otherwise (quantized as they age)."""
    if generated is None:
        generated = max(H - 1, 0) * n_kv * 2 * head_dim * itemsize
    return CacheBytes(start=[int(b) for b in prompt], end=[int(b) + generated for b in prompt])
