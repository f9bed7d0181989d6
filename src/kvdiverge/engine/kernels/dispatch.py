"""The registered candidates and the two calls the attention function makes through them.

Candidates, in order of preference per layout (``docs/engine.md``, "Attention kernels"):

==================  =======================================  ==============================
kernel              layouts                                  where
==================  =======================================  ==============================
native-avx512       prompt_gathered, prompt_ragged,          CPU float32, head size a
                    prompt_masked                            multiple of 16 up to 128,
                                                             AVX-512 and a C compiler
library-flash-cpu   every layout                             CPU (torch's flash kernel)
library-flash-cuda  rows_own, prompt_gathered                CUDA fp16/bf16
library-efficient-  every layout (masks as a padded-stride   CUDA (memory-efficient kernel)
cuda                bias)
reference-float32   every layout                             everywhere (the oracle)
==================  =======================================  ==============================

Each is validated against the reference before its first use per (layout, device, dtype, head
size) (:mod:`kvdiverge.engine.kernels.registry`).
"""

from __future__ import annotations

import torch

from kvdiverge.engine.kernels import library, native, registry
from kvdiverge.engine.kernels.reference import math_attention, prompt_reference
from kvdiverge.engine.kernels.registry import Candidate, Key

__all__ = ["PROMPT_LAYOUTS", "attend_own", "attend_prompt", "fused_masked_kernel"]

PROMPT_LAYOUTS = ("prompt_gathered", "prompt_ragged", "prompt_masked")
_HALF = (torch.float16, torch.bfloat16)
_FAILURES = (RuntimeError, NotImplementedError, TypeError, ValueError)


def _on(device: str, dtypes: tuple[torch.dtype, ...] | None = None):
    def claims(key: Key) -> bool:
        return key[1] == device and (dtypes is None or key[2] in dtypes)

    return claims


def _native_claims(key: Key) -> bool:
    _, device, dtype, d = key
    return (
        device == "cpu"
        and dtype == torch.float32
        and d % 16 == 0
        and 0 < d <= 128
        and native.library() is not None
    )


def _native_run(q, k, v, scale, table=None, rows=None):
    return native.attend(q, k, v, scale, table, rows)


def _register_all() -> None:
    reg = registry.register
    reg(Candidate("native-avx512", PROMPT_LAYOUTS, _native_run, _native_claims, kind="native"))
    cpu, cuda = _on("cpu"), _on("cuda")
    reg(Candidate("library-flash-cpu", ("rows_own",), library.cpu_flash, cpu))
    reg(Candidate("library-flash-cpu", PROMPT_LAYOUTS, library.prompt_call(library.cpu_flash), cpu))
    half = _on("cuda", _HALF)
    reg(Candidate("library-flash-cuda", ("rows_own",), library.cuda_flash, half))
    flash = library.prompt_call(library.cuda_flash)
    reg(Candidate("library-flash-cuda", ("prompt_gathered",), flash, half))
    reg(Candidate("library-efficient-cuda", ("rows_own",), library.cuda_efficient, cuda))
    efficient = library.prompt_call(library.cuda_efficient)
    reg(Candidate("library-efficient-cuda", PROMPT_LAYOUTS, efficient, cuda))
    every = lambda key: True  # noqa: E731
    reg(Candidate("reference-float32", ("rows_own",), math_attention, every, kind="reference"))
    reg(Candidate("reference-float32", PROMPT_LAYOUTS, prompt_reference, every, kind="reference"))


_register_all()


def attend_own(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, fused: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``rows_own`` layout: (B, h, s, d) × (B, h, n, d) → float32 output and log-sum-exp
    (B, h, s), through the registry's kernel (``fused=False``: the reference)."""
    while True:
        cand = registry.choose("rows_own", q.device, q.dtype, q.shape[-1], fused=fused)
        if cand.oracle or not (q.numel() and k.numel()):  # (fused kernels may fault on empty)
            return math_attention(q, k, v, scale)
        try:
            out, lse = cand.run(q, k, v, scale)
            return out.float(), lse.float()
        except _FAILURES as exc:
            registry.drop(cand, "rows_own", q.device, q.dtype, q.shape[-1], exc)


def attend_prompt(
    layout: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    table: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    fused: bool = True,
    native: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt layout: q (H_kv, M, d) over k, v (H_kv, n, d), each query row m with the bias
    ``table[rows[m]]`` (T, H_kv, n) additive (none for −1, or without a table) → float32
    output (H_kv, M, d) and log-sum-exp (H_kv, M), through the registry's kernel."""
    while True:
        cand = registry.choose(layout, q.device, q.dtype, q.shape[-1], fused=fused, native=native)
        if cand.oracle or not (q.numel() and k.numel()):
            return prompt_reference(q, k, v, scale, table, rows)
        try:
            out, lse = cand.run(q, k, v, scale, table, rows)
            return out.float(), lse.float()
        except _FAILURES as exc:
            registry.drop(cand, layout, q.device, q.dtype, q.shape[-1], exc)


def fused_masked_kernel(device: torch.device | str, dtype: torch.dtype, head_size: int) -> bool:
    """Whether the masked layout has a validated kernel other than the reference here (where
    not, the engine attends to gathered caches instead: ``docs/engine.md``)."""
    return not registry.choose("prompt_masked", device, dtype, head_size, record=False).oracle
