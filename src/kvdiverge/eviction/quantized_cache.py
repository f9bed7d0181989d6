"""transformers' ``QuantizedCache`` as an action (``selector: quantized-cache``): the prompt cache
its quanto or HQQ backend attends to after the prefill, computed by that backend.

An action ``{selector: quantized-cache, backend: quanto, nbits: 4, q_group_size: 64,
residual_length: 128, axis_key: 0, axis_value: 0}`` takes transformers' own parameters
(``transformers.QuantizedCache(backend, config, nbits, axis_key, axis_value, q_group_size,
residual_length)``, transformers' defaults where left out, ``quanto`` the default backend):
``backend`` ``quanto`` (the ``optimum-quanto`` package, nbits 2 or 4, axes 0 or −1) or ``hqq``
(the ``hqq`` package, nbits 1, 2, 3, 4 or 8, axes 0 or 1).

What transformers' cache holds after the prefill. Each layer is a ``QuantoQuantizedLayer`` or an
``HQQQuantizedLayer``. Its first ``update`` (the prefill's n entries) quantizes all n of them,
keys with ``axis_key`` and values with ``axis_value``, returns the full-precision ones for the
prefill's own attention, and leaves its full-precision residual empty: the residual collects
generated entries only, so ``residual_length`` never keeps a prompt entry in full precision
(unlike ``quantize``'s ``residual``). The next call attends to the dequantized prompt, then the
residual, then its own new entry. This action's prompt cache is that dequantized prompt: each
layer's keys and values are passed, as transformers holds them for a prompt alone (a batch of
one, (1, H_kv, n, d)), to a fresh layer of transformers' own class (``update``), and read back
through its ``_dequantize``, so the backend's own quantize and dequantize compute them
(:func:`quantized_entries`). The engine attends to them as to any prompt transformation
(:mod:`kvdiverge.eviction.transforms`).

The groups of G = ``q_group_size`` elements, over the row-major order of the (1, H_kv, n, d)
tensor of N = H_kv·n·d elements:

* quanto, axis 0, and hqq, axis 1: G consecutive elements (G channels of one token when G
  divides d; whole tokens of one KV head when d divides G); G must divide N;
* quanto, axis −1: for each channel, G consecutive rows of the (H_kv·n, d) matrix, that is G
  consecutive tokens, crossing into the next KV head when G does not divide n; G must divide
  H_kv·n;
* hqq, axis 0: the tensor viewed as (G, N/G), each column one group: the G elements at a stride
  of N/G; G must divide N.

Each group x is quantized to b = ``nbits`` bits. quanto (``MaxOptimizer``, ``quantize_weight``,
``dequantize``): scale s = (max x − min x)/(2^b − 1) and shift −min x in the cache's dtype, code
q = clamp(round((x − min x)/s), 0, 2^b − 1), entry s·q + min x. hqq (``Quantizer.quantize`` with
its default ``optimize=True``, as transformers calls it): the min/max zero point and scale, then
up to 20 iterations of HQQ's half-quadratic refinement of the zero point (in float32 on the CPU,
float16 on CUDA), code q = clamp(round(x/s + z), 0, 2^b − 1), entry (q − z)·s in the cache's
dtype. A prompt whose shape the backend cannot group, or that transformers' cache cannot hold,
is refused in one line before its first layer is transformed (:func:`shape_problem`).

Generated entries. The engine keeps each row's own generated entries in full precision (their
bytes too, ``docs/engine.md``, "Cache bytes"). transformers' cache keeps them in its residual in
full precision until call max(R, 2) (R = ``residual_length``; the prefill is call 0): calls
1 … max(R, 2) attend to the dequantized prompt and full-precision generated entries, exactly
what this action's rows attend to. At call max(R, 2) transformers re-quantizes the whole layer
(the dequantized prompt, the residual and the new entry, grouped afresh) and empties its
residual, and again each time the residual refills; this action does not reproduce that. Its
laws are therefore transformers' own at steps 1 … max(R, 2) + 1 (step t + 1 follows call t),
over the whole horizon when H ≤ max(R, 2) + 1 (the default R = 128 and H = 32, say), and from
step max(R, 2) + 2 on they are those of transformers' prompt quantization with full-precision
generated entries. (transformers' own cache also fails at a re-quantization whose new length
its backend cannot group; this action never re-quantizes.)

Bytes per layer (:func:`quantized_cache_layer_bytes`), keys and values each with its own axis,
s the dtype's bytes, N/G groups per tensor:

* quanto: the codes packed 8/b to a byte along the first axis of the grouped matrix, (N/G, G)
  for axis 0 and (G, N/G) for axis −1: ⌈(N/G)·b/8⌉·G or ⌈G·b/8⌉·(N/G) bytes; a scale and a
  shift per group: 2·(N/G)·s;
* hqq: the codes packed along the first axis of the grouped matrix, G rows for axis 0, N/G for
  axis 1: N bytes at b = 8, N·b/8 at b = 1, 2, 4 (hqq packs these without padding: the row count
  must be a multiple of 8/b), ⌈rows/10⌉·(N/rows) int32 words of 4 bytes at b = 3; a scale and a
  zero point per group: 2·(N/G)·s;
* the residual: empty after the prefill, 0 bytes.
"""

from __future__ import annotations

import importlib.metadata
import re
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
    "BACKENDS",
    "Backend",
    "QuantizedCacheSelector",
    "quantized_cache_layer_bytes",
    "quantized_entries",
    "shape_problem",
]


@dataclass(frozen=True)
class Backend:
    """One of transformers' ``QuantizedCache`` backends: the package it needs (``package``, at
    least ``minimum``), its layer class in ``transformers.cache_utils`` and the ``nbits`` and
    axes that class accepts."""

    package: str
    minimum: tuple[int, ...]
    layer: str
    nbits: tuple[int, ...]
    axes: tuple[int, ...]


BACKENDS = {
    "quanto": Backend("optimum-quanto", (0, 2, 5), "QuantoQuantizedLayer", (2, 4), (0, -1)),
    "hqq": Backend("hqq", (0, 2, 1), "HQQQuantizedLayer", (1, 2, 3, 4, 8), (0, 1)),
}
"""The backends transformers' ``QuantizedCache`` takes, by its ``backend`` names."""


def _version(text: str) -> tuple[int, ...]:
    """The release numbers of a version string (``0.2.8.post1`` → (0, 2, 8))."""
    parts = []
    for part in text.split("."):
        digits = re.match(r"[0-9]+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.end() < len(part):  # 0rc1: a pre-release of 0
            break
    return tuple(parts)


def _missing_package(backend: Backend) -> str | None:
    """Why the backend's package cannot be used here, or ``None``."""
    try:
        installed = importlib.metadata.version(backend.package)
    except importlib.metadata.PackageNotFoundError:
        return f"not installed; install it with pip install {backend.package}"
    if _version(installed) < backend.minimum:
        least = ".".join(map(str, backend.minimum))
        return f"{installed} is installed; transformers needs >= {least}"
    return None


def _packing(nbits: int) -> int:
    """Codes per packed unit of hqq's bit packing (8 for 1 bit, 4, 2, 1 for 8 bits; 10 for 3)."""
    return 10 if nbits == 3 else 8 // nbits


def _grouped_rows(backend: str, axis: int, n_elements: int, group: int) -> int:
    """Rows of the grouped matrix the backend packs its codes along (module docstring)."""
    if backend == "quanto":
        return n_elements // group if axis == 0 else group
    return group if axis == 0 else n_elements // group


def _tensor_bytes(
    backend: str, axis: int, n_elements: int, nbits: int, group: int, itemsize: int
) -> int:
    groups = n_elements // group
    rows = _grouped_rows(backend, axis, n_elements, group)
    cols = n_elements // rows
    if backend == "quanto":
        codes = -(-rows // (8 // nbits)) * cols
    elif nbits == 3:
        codes = -(-rows // 10) * cols * 4
    else:
        codes = n_elements * nbits // 8
    return codes + 2 * groups * itemsize


def quantized_cache_layer_bytes(
    backend: str,
    n: int,
    n_kv: int,
    head_dim: int,
    nbits: int,
    axis_key: int,
    axis_value: int,
    q_group_size: int,
    itemsize: int,
) -> int:
    """Bytes of one layer's quantized prompt cache of n entries (module docstring): the packed
    codes, scales and zero points (shifts) of keys and values, and an empty residual."""
    n_elements = n_kv * n * head_dim
    return sum(
        _tensor_bytes(backend, axis, n_elements, nbits, q_group_size, itemsize)
        for axis in (axis_key, axis_value)
    )


def shape_problem(
    backend: str, nbits: int, axis: int, q_group_size: int, n: int, n_kv: int, head_dim: int
) -> str | None:
    """Why the backend cannot quantize an (1, n_kv, n, head_dim) tensor along ``axis`` in groups
    of ``q_group_size`` (module docstring), or ``None``."""
    g = q_group_size
    n_elements = n_kv * n * head_dim
    if backend == "quanto" and axis == -1:
        if (n_kv * n) % g:
            return (
                f"groups {g} consecutive tokens per channel over {n_kv} KV heads × {n} tokens "
                f"= {n_kv * n} rows, which {g} does not divide"
            )
    elif n_elements % g:
        size = f"{n_kv}·{n}·{head_dim} = {n_elements}"
        return f"groups {g} elements of {size}, which {g} does not divide"
    if backend == "quanto" and n_elements == g:
        return f"holds a single group of {g} elements (quanto then scales each element alone)"
    rows = _grouped_rows(backend, axis, n_elements, g)
    if backend == "hqq" and nbits in (1, 2, 4) and rows % _packing(nbits):
        return (
            f"packs {_packing(nbits)} codes of {nbits} bits along {rows} rows, not a multiple of "
            f"{_packing(nbits)} (hqq does not pad them)"
        )
    return None


def _layer(method: QuantizedCacheSelector):
    """A fresh transformers layer of the action's backend (its own class and checks)."""
    from transformers import cache_utils

    cls = getattr(cache_utils, BACKENDS[method.backend].layer)
    return cls(
        method.nbits,
        method.axis_key,
        method.axis_value,
        method.q_group_size,
        method.residual_length,
    )


def quantized_entries(
    method: QuantizedCacheSelector, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's prompt keys and values (H_kv, n, d) as transformers' QuantizedCache attends to
    them after the prefill (module docstring): quantized by a fresh layer of the backend's own
    class and dequantized by it, in the prefill's dtype (new tensors; the inputs are left as
    they are)."""
    layer = _layer(method)
    layer.update(keys.unsqueeze(0), values.unsqueeze(0))
    out_keys = layer._dequantize(layer._quantized_keys)[0]
    out_values = layer._dequantize(layer._quantized_values)[0]
    return out_keys.contiguous().clone(), out_values.contiguous().clone()


@register_selector
@dataclass(frozen=True)
class QuantizedCacheSelector(PromptTransform):
    """transformers' ``QuantizedCache`` prompt cache (module docstring), with transformers' own
    parameters: ``backend`` (quanto or hqq), ``nbits``, ``axis_key``, ``axis_value``,
    ``q_group_size`` and ``residual_length`` (which acts only on generated entries there; here
    they stay in full precision)."""

    name: ClassVar[str] = "quantized-cache"
    backend: str = "quanto"
    nbits: int = 4
    axis_key: int = 0
    axis_value: int = 0
    q_group_size: int = 64
    residual_length: int = 128

    def validate(self, action: ActionSpec, where: str) -> None:
        if action.budget is not None:
            raise ActionError(
                f"{where}.budget: selector 'quantized-cache' takes nbits, not a budget (nbits: 4 "
                "in a config, quantized-cache@4bit in kvdiverge compare; its memory is counted "
                "in bytes)"
            )
        backend = BACKENDS.get(self.backend)
        if backend is None:
            raise ActionError(
                f"{where}.backend: expected one of {', '.join(BACKENDS)} (transformers' "
                f"QuantizedCache backends), got {self.backend!r}"
            )
        if problem := _missing_package(backend):
            raise ActionError(
                f"{where}.backend: {self.backend} needs the {backend.package} package: {problem}"
            )
        if self.nbits not in backend.nbits:
            raise ActionError(
                f"{where}.nbits: expected one of {', '.join(map(str, backend.nbits))} for backend "
                f"{self.backend}, got {self.nbits!r}"
            )
        for field in ("axis_key", "axis_value"):
            axis = getattr(self, field)
            if axis not in backend.axes:
                raise ActionError(
                    f"{where}.{field}: expected one of {', '.join(map(str, backend.axes))} for "
                    f"backend {self.backend}, got {axis!r}"
                )
            if self.backend == "hqq" and self.nbits == 3 and axis == 1:
                raise ActionError(
                    f"{where}.{field}: axis 1 with nbits 3 is refused for backend hqq (hqq's "
                    "3-bit unpacking keeps the rows of a 2-D weight, not those of a cache's 4-D "
                    "tensor); expected axis 0, or another nbits"
                )
        if self.q_group_size < 1:
            raise ActionError(
                f"{where}.q_group_size: expected an integer >= 1, got {self.q_group_size}"
            )
        if self.residual_length < 0:
            raise ActionError(
                f"{where}.residual_length: expected an integer >= 0, got {self.residual_length}"
            )

    def check_shape(self, action: ActionSpec, n: int, n_kv: int, head_dim: int) -> None:
        for field in ("axis_key", "axis_value"):
            axis = getattr(self, field)
            problem = shape_problem(
                self.backend, self.nbits, axis, self.q_group_size, n, n_kv, head_dim
            )
            if problem:
                raise ActionError(
                    f"action {action.name!r}: selector 'quantized-cache': backend "
                    f"{self.backend} with {field} {axis} {problem}, for this {n}-token prompt; "
                    "transformers' QuantizedCache cannot hold it either (expected another "
                    "q_group_size or axis)"
                )

    def transform_layer(
        self,
        action: ActionSpec,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return quantized_entries(self, keys, values)

    def layer_bytes(
        self, action: ActionSpec, n: int, n_kv: int, head_dim: int, itemsize: int
    ) -> int:
        return quantized_cache_layer_bytes(
            self.backend,
            n,
            n_kv,
            head_dim,
            self.nbits,
            self.axis_key,
            self.axis_value,
            self.q_group_size,
            itemsize,
        )
