"""Compression during decoding: actions that re-compress each row's cache as it generates.

A prompt selection keeps a subset of the prompt's entries once, after the prefill; a prompt
transformation replaces them once by tensors of its own. A :class:`DecodingCompressor` acts
while the rows decode: every ``interval`` decoding calls, or once a row's cache holds more than
``max_entries`` entries per KV head in a layer (:meth:`DecodingCompressor.schedule`), the engine
hands it that row's whole cache of that layer — the prompt entries it still holds and its own
generated entries — and keeps the entries it returns. Each row is compressed from its own
history (its own tokens, its own keys and values), so rows that have diverged keep different
entries (``docs/compression.md``, "Compression during decoding").

The interface is one method, :meth:`DecodingCompressor.compress`: given one row's layer cache in
its order — keys and values (H_kv, L, d) (keys post-RoPE) and their absolute positions (H_kv, L)
(prompt positions 0..n − 1, the entry of generated token t at n + t − 1) — return the indices
(H_kv, m) of the entries to keep, in the order the compressed cache holds them (kvpress's own
caches are ordered by score, not position, and a later compression reads that order). The order
of a row's cache is the order its last compression returned, then the entries generated since,
oldest first; before any compression, the prompt in position order, then the generated entries.
:func:`checked_kept` checks what it returns (one :class:`ActionError` line naming the action,
the layer and what was expected): an integer tensor (H_kv, m), 1 <= m <= L, the same m for every
KV head of the layer, each value in [0, L), distinct per head.

The prompt part of a decoding action is its whole prompt (it takes no budget); its bytes are
entries × 2 (keys and values) × head size × the dtype's bytes, as a kept subset's, counted per row
from the entries each row holds.

The built-in one, ``selector: streaming`` (:class:`StreamingCompressor`), is StreamingLLM's cache
(Xiao et al., 2024) during decoding: once a row holds more than ``sinks + window`` entries, it
keeps the ``sinks`` entries of the lowest positions and the ``window`` entries of the highest.
kvpress's ``DecodingPress`` is bridged in :mod:`kvdiverge.eviction.kvpress_decoding`.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from kvdiverge.eviction.budgets import ActionError
from kvdiverge.eviction.contract import WholePrompt, selector_label, user_call
from kvdiverge.eviction.selectors import Selector, register_selector

if typing.TYPE_CHECKING:  # torch is imported where it runs: parsing a config does not load it
    import torch

    from kvdiverge.eviction.selectors import ActionSpec

__all__ = [
    "DecodingCompressor",
    "StreamingCompressor",
    "checked_kept",
    "checked_schedule",
    "is_decoding",
]


class DecodingCompressor(WholePrompt, Selector):
    """Base class of decoding-time compressors (module docstring).

    It keeps every prompt position after the prefill (its selection step is the identity) and
    takes no ``budget``, refused in one line (:class:`~kvdiverge.eviction.contract.WholePrompt`):
    its parameters say how much a row keeps. Subclasses declare their
    parameters as dataclass fields, as selectors do, and implement :meth:`schedule` and
    :meth:`compress`.
    """

    decodes: ClassVar[bool] = True
    acts_on: ClassVar[str] = "compresses each row's cache during decoding"
    sized_by: ClassVar[str] = "its parameters set the sizes"

    def schedule(self, action: ActionSpec) -> tuple[int, int]:
        """(interval, max_entries): a row's layer cache is compressed after every ``interval``
        decoding calls since its last compression (0: never by count), and after any call that
        leaves it more than ``max_entries`` entries per KV head (0: never by size)."""
        raise NotImplementedError

    def compress(
        self,
        action: ActionSpec,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """Indices (H_kv, m) into the row's ``keys``/``values`` (H_kv, L, d) of the entries kept,
        in the compressed cache's order; ``positions`` (H_kv, L): their absolute positions. Must
        not modify its inputs."""
        raise NotImplementedError


def is_decoding(action: Any) -> bool:
    """Whether a parsed action compresses its rows' caches during decoding."""
    return bool(getattr(getattr(action, "method", None), "decodes", False))


def checked_schedule(action: ActionSpec) -> tuple[int, int]:
    """The action's (interval, max_entries), checked: two integers >= 0, not both 0."""
    got = user_call(action, "schedule", action.method.schedule, action)
    ok = isinstance(got, tuple) and len(got) == 2
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in got)
    if not ok or got == (0, 0):
        raise ActionError(
            f"action {action.name!r}: {selector_label(action)}: schedule returned {got!r}; "
            "expected (interval, max_entries), integers >= 0, not both 0"
        )
    return got


def checked_kept(kept: Any, action: ActionSpec, layer: int, n_kv: int, length: int) -> Any:
    """A compressor's kept indices for a row's layer cache of ``length`` entries per KV head,
    checked (module docstring), as int64."""
    import torch

    where = f"action {action.name!r}: {selector_label(action)}: compress of layer {layer}"
    if not isinstance(kept, torch.Tensor):
        raise ActionError(
            f"{where} returned {type(kept).__name__}; expected an integer torch.Tensor ({n_kv}, m)"
        )
    if kept.dtype.is_floating_point or kept.dtype.is_complex or kept.dtype == torch.bool:
        raise ActionError(f"{where} returned a {kept.dtype} tensor; expected integer indices")
    if kept.dim() != 2 or kept.shape[0] != n_kv or not 1 <= kept.shape[1] <= length:
        raise ActionError(
            f"{where} returned shape {tuple(kept.shape)}; expected ({n_kv}, m) with "
            f"1 <= m <= {length} (KV heads, kept entries of the row's {length})"
        )
    kept = kept.long()
    if bool(((kept < 0) | (kept >= length)).any()):
        raise ActionError(
            f"{where} returned an index outside [0, {length}); expected indices into the row's "
            f"{length} entries"
        )
    ordered = kept.sort(dim=-1).values
    if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        raise ActionError(f"{where} returned an index twice in a KV head; expected distinct ones")
    return kept


def _sizes(where: str, **sizes: int) -> None:
    for name, (value, low) in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ActionError(f"{where}.{name}: expected an integer >= {low}, got {value!r}")


@register_selector
@dataclass(frozen=True)
class StreamingCompressor(DecodingCompressor):
    """StreamingLLM during decoding: a row keeps its ``sinks`` lowest-position entries and its
    ``window`` highest-position ones once it holds more than ``sinks + window`` (module
    docstring). Its compressed cache is in position order."""

    name: ClassVar[str] = "streaming"
    sinks: int = 4
    window: int = 64

    def validate(self, action: ActionSpec, where: str) -> None:
        super().validate(action, where)
        _sizes(where, sinks=(self.sinks, 0), window=(self.window, 1))

    def schedule(self, action: ActionSpec) -> tuple[int, int]:
        return 0, self.sinks + self.window

    def compress(self, action, layer, keys, values, positions):
        order = positions.argsort(dim=-1)
        length = positions.shape[-1]
        if length <= self.sinks + self.window:
            return order
        return order[:, list(range(self.sinks)) + list(range(length - self.window, length))]
