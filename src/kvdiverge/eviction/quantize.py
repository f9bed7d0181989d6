"""A KIVI-style quantized prompt cache as an action (``selector: quantize``).

KIVI (Liu et al., 2024) quantizes keys per channel and values per token, asymmetrically (a
zero point and a scale per group, from the group's minimum and maximum), keeping the most
recent entries in full precision. Here, for one layer's prompt cache of n entries per KV head
(keys and values (H_kv, n, d)), ``bits`` b, ``group_size`` G and ``residual`` r:

* the residual window: the last min(r, n) entries stay in full precision;
* keys, per channel: the first n_k = ⌊(n − min(r, n)) / G⌋ · G entries are quantized in groups
  of G consecutive entries of one channel (one scale and zero point per channel and group of
  G tokens); the n − n_k entries after them (the window and the incomplete group before it,
  which KIVI also keeps in full precision until it fills) stay in full precision;
* values, per token: the first n_v = n − min(r, n) entries are quantized in groups of G
  consecutive channels of one token (G must divide the head size d);
* each group x: m = min x, M = max x, stored in the cache's dtype as the zero point z = m and
  the scale s = (M − m)/(2^b − 1) (both rounded to that dtype); the code
  q = clamp(round((x − z)/s), 0, 2^b − 1) (round half to even, as torch and numpy round; q = 0
  where s = 0) and the dequantized entry z + q·s, computed in float64 and rounded to the cache's
  dtype (:func:`quantize_dequantize_groups`).

The engine attends to the dequantized entries (:mod:`kvdiverge.eviction.transforms`), exactly
what a dequantize-then-attend kernel computes. The prompt part is one cache shared by every
row of the action, quantized once after the prefill: its residual window is the prompt's last
r entries and does not move as the rows generate.

Generated entries (``generated``, default false). By default each row's own generated entries
stay in full precision. With ``generated: true`` (KIVI's streaming part) each Y and Z row of
the action quantizes its own generated entries as they age, from its own history, with the
same b, G and r: after the model call that appends a row's t-th generated entry (t per layer
and KV head, the same count for every row of a batch), that row's t generated entries are
KIVI's cache of them as above with n = t, keeping their order:

* the window: the row's last min(r, t) generated entries stay in full precision;
* keys, per channel: its first ⌊(t − min(r, t))/G⌋·G generated entries, in groups of G
  consecutive generated entries counted from the first one; a group is quantized once all of
  its G entries have left the window (the incomplete group stays in full precision until then);
* values, per token: its first t − min(r, t) generated entries, each as soon as it leaves the
  window, in groups of G channels;
* each group is quantized once, from the full-precision entries the model wrote, with the
  rounding of :func:`quantize_dequantize_groups`, and the row attends to the dequantized
  entries from the next call on (a call attends to its own new entry in full precision).

The prompt part keeps its own quantization and its own window (above); the generated entries
are quantized apart from it, per row. A Z row, which starts from a copy of its Y row's
generated entries at the split, inherits them as they are and goes on from there. The X rows
and every other action's rows are never touched (the engine's part:
:mod:`kvdiverge.engine.generated_quantization`).

Bytes per layer (:func:`kivi_layer_bytes`): per KV head, the packed codes ⌈n_k·d·b/8⌉ +
⌈n_v·d·b/8⌉ bytes, a scale and a zero point per group in the cache's dtype
((n_k/G)·d + n_v·(d/G) groups), and the full-precision entries ((n − n_k) + (n − n_v))·d in
the cache's dtype. With ``generated: true`` a row's generated part at step H (H − 1 entries)
holds :func:`kivi_layer_bytes` of n = H − 1 entries besides (:func:`generated_bytes`).
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import ClassVar

from kvdiverge.eviction.budgets import ActionError
from kvdiverge.eviction.selectors import register_selector
from kvdiverge.eviction.transforms import PromptTransform

if typing.TYPE_CHECKING:  # torch is imported where it runs: parsing a config does not load it
    import torch

    from kvdiverge.eviction.selectors import ActionSpec

__all__ = [
    "BITS",
    "QuantizeSelector",
    "generated_bytes",
    "kivi_keys",
    "kivi_layer_bytes",
    "kivi_split",
    "kivi_values",
    "quantize_dequantize_groups",
]

BITS = (2, 4, 8)
"""The bit widths a ``quantize`` action takes."""


def quantize_dequantize_groups(groups: torch.Tensor, bits: int) -> torch.Tensor:
    """Asymmetric min/max quantize-dequantize of every group along the last axis of ``groups``
    (module docstring): zero point and scale rounded to ``groups``' dtype, codes in
    [0, 2^bits − 1], the dequantized values in float64 rounded back to that dtype."""
    import torch

    dtype = groups.dtype
    x = groups.double()
    low = x.amin(dim=-1, keepdim=True)
    high = x.amax(dim=-1, keepdim=True)
    top = 2**bits - 1
    zero = low.to(dtype).double()
    scale = ((high - low) / top).to(dtype).double()
    positive = scale > 0
    ratio = (x - zero) / torch.where(positive, scale, torch.ones_like(scale))
    codes = torch.where(positive, ratio.round().clamp(0, top), torch.zeros_like(ratio))
    return (zero + codes * scale).to(dtype)


def kivi_split(n: int, group_size: int, residual: int) -> tuple[int, int]:
    """(n_k, n_v): the entries of an n-entry prompt whose keys, and whose values, are quantized
    (the rest stay in full precision; module docstring)."""
    quantized = n - min(residual, n)
    return (quantized // group_size) * group_size, quantized


def kivi_keys(keys: torch.Tensor, bits: int, group_size: int, residual: int) -> torch.Tensor:
    """Keys (H_kv, n, d) quantized per channel in groups of ``group_size`` tokens, the last
    entries in full precision (a new tensor; ``keys`` is left as it is)."""
    import torch

    h, n, d = keys.shape
    n_k, _ = kivi_split(n, group_size, residual)
    if n_k == 0:
        return keys.clone()
    part = keys[:, :n_k].reshape(h, n_k // group_size, group_size, d).transpose(2, 3)
    done = quantize_dequantize_groups(part, bits).transpose(2, 3).reshape(h, n_k, d)
    return torch.cat([done, keys[:, n_k:]], dim=1)


def kivi_values(values: torch.Tensor, bits: int, group_size: int, residual: int) -> torch.Tensor:
    """Values (H_kv, n, d) quantized per token in groups of ``group_size`` channels (which must
    divide d), the last ``residual`` entries in full precision (a new tensor)."""
    import torch

    h, n, d = values.shape
    _, n_v = kivi_split(n, group_size, residual)
    if d % group_size:
        raise ValueError(f"group_size {group_size} does not divide the head size {d}")
    if n_v == 0:
        return values.clone()
    part = values[:, :n_v].reshape(h, n_v, d // group_size, group_size)
    done = quantize_dequantize_groups(part, bits).reshape(h, n_v, d)
    return torch.cat([done, values[:, n_v:]], dim=1)


def kivi_layer_bytes(
    n: int, n_kv: int, head_dim: int, bits: int, group_size: int, residual: int, itemsize: int
) -> int:
    """Bytes of one layer's quantized prompt cache (module docstring): packed codes, scales and
    zero points, and the full-precision entries, for ``n_kv`` KV heads."""
    n_k, n_v = kivi_split(n, group_size, residual)
    d = head_dim
    codes = math.ceil(n_k * d * bits / 8) + math.ceil(n_v * d * bits / 8)
    groups = (n_k // group_size) * d + n_v * (d // group_size)
    full = ((n - n_k) + (n - n_v)) * d
    return n_kv * (codes + (2 * groups + full) * itemsize)


@register_selector
@dataclass(frozen=True)
class QuantizeSelector(PromptTransform):
    """KIVI's quantized prompt cache (module docstring): ``bits`` (2, 4 or 8), ``group_size``
    (entries per key group, channels per value group), ``residual`` (the most recent entries
    kept in full precision) and ``generated`` (each row's own generated entries quantized as
    they age, with the same bits, group size and window; default false: full precision)."""

    name: ClassVar[str] = "quantize"
    bits: int = 4
    group_size: int = 32
    residual: int = 0
    generated: bool = False

    def validate(self, action: ActionSpec, where: str) -> None:
        if action.budget is not None:
            raise ActionError(
                f"{where}.budget: selector 'quantize' takes bits, not a budget (bits: 4 in a "
                "config, quantize@4bit in kvdiverge compare; its memory is counted in bytes)"
            )
        if self.bits not in BITS:
            raise ActionError(
                f"{where}.bits: expected one of {', '.join(map(str, BITS))}, got {self.bits!r}"
            )
        if self.group_size < 1:
            raise ActionError(
                f"{where}.group_size: expected an integer >= 1, got {self.group_size}"
            )
        if self.residual < 0:
            raise ActionError(f"{where}.residual: expected an integer >= 0, got {self.residual}")

    def check_shape(self, action: ActionSpec, n: int, n_kv: int, head_dim: int) -> None:
        if head_dim % self.group_size:
            raise ActionError(
                f"action {action.name!r}: selector 'quantize': group_size {self.group_size} "
                f"does not divide the model's head size {head_dim} (values are quantized per "
                "token in groups of group_size channels); expected a divisor of it"
            )

    def transform_layer(
        self,
        action: ActionSpec,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            kivi_keys(keys, self.bits, self.group_size, self.residual),
            kivi_values(values, self.bits, self.group_size, self.residual),
        )

    def layer_bytes(
        self, action: ActionSpec, n: int, n_kv: int, head_dim: int, itemsize: int
    ) -> int:
        return kivi_layer_bytes(
            n, n_kv, head_dim, self.bits, self.group_size, self.residual, itemsize
        )


def generated_bytes(
    action: ActionSpec, H: int, n_kv: int, head_dim: int, itemsize: int
) -> int | None:
    """Bytes of one layer's generated part at step H (H − 1 entries per row) of a ``quantize``
    action with ``generated: true``: :func:`kivi_layer_bytes` of n = H − 1 entries (module
    docstring); ``None`` for any other action (its generated entries stay in full precision)."""
    method = getattr(action, "method", None)
    if not (isinstance(method, QuantizeSelector) and method.generated):
        return None
    return kivi_layer_bytes(
        max(H - 1, 0), n_kv, head_dim, method.bits, method.group_size, method.residual, itemsize
    )
