"""The registered candidates and the two calls the attention function makes through them.

Candidates, in order of preference per layout (``docs/engine.md``, "Attention kernels"):

==================  =======================================  ==============================
kernel              layouts                                  where
==================  =======================================  ==============================
native-avx512       rows_own (merging with the prompt        CPU float32, head size a
                    part), prompt_gathered, prompt_ragged,   multiple of 16 up to 128,
                    prompt_masked                            AVX-512 and a C compiler
library-flash-cpu   every layout (prompt layouts in blocks   CPU (torch's flash kernel)
                    of 32 query rows)
library-flash-cuda  rows_own, prompt_gathered                CUDA fp16/bf16
library-efficient-  every layout (masks as a padded-stride   CUDA (memory-efficient kernel)
cuda                bias)
reference-float32   every layout                             everywhere (the oracle)
==================  =======================================  ==============================

Each is validated against the reference before its first use per (layout, device, dtype, head
size) (:mod:`kvdiverge.engine.kernels.registry`), and on the CPU checked to give every row the
same bits wherever it lies in a call (:func:`~kvdiverge.engine.kernels.reference.stable`); the
native ``rows_own`` candidate also merges
the two parts of the attention in its pass (:func:`attend_own` with ``prompt``), and its
validation covers that merge against :func:`merge`.
"""

from __future__ import annotations

import torch

from kvdiverge.engine.kernels import library, native, registry
from kvdiverge.engine.kernels.reference import (
    ROW_BLOCK,
    agrees,
    math_attention,
    prompt_reference,
    validation_problems,
)
from kvdiverge.engine.kernels.registry import Candidate, Key

__all__ = ["PROMPT_LAYOUTS", "attend_own", "attend_prompt", "fused_masked_kernel", "merge"]

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


def _native_own(q, k, v, scale, o_pre=None, lse_pre=None):
    return native.attend_own(q, k, v, scale, o_pre, lse_pre)


_MERGING = (_native_own,)  # rows_own kernels that also merge the prompt part in their pass


def _native_own_validates(key: Key) -> bool:
    """The native ``rows_own`` kernel agrees with the reference (:func:`agrees`), and merged
    with a prompt part (random outputs, log-sum-exps around the own ones, one −inf: an empty
    prompt part) agrees with :func:`merge` of the reference's parts (1e-5)."""
    layout, device, dtype, d = key
    if not agrees(_native_own, layout, dtype, device, d):
        return False
    gen = torch.Generator().manual_seed(2)
    for q, k, v in validation_problems(layout, dtype, device, d):
        o_own, lse_own = math_attention(q, k, v, d**-0.5)
        o_pre = torch.randn(o_own.shape, generator=gen).to(device)
        lse_pre = lse_own + 4 * torch.randn(lse_own.shape, generator=gen).to(device)
        lse_pre.view(-1)[0] = float("-inf")
        got = _native_own(q, k, v, d**-0.5, o_pre, lse_pre)[0]
        want = merge(o_own, lse_own, o_pre, lse_pre)
        if got.shape != want.shape or not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
            return False
    return True


def _register_all() -> None:
    reg = registry.register
    reg(
        Candidate(
            "native-avx512",
            ("rows_own",),
            _native_own,
            _native_claims,
            _native_own_validates,
            kind="native",
        )
    )
    reg(Candidate("native-avx512", PROMPT_LAYOUTS, _native_run, _native_claims, kind="native"))
    cpu, cuda = _on("cpu"), _on("cuda")
    reg(Candidate("library-flash-cpu", ("rows_own",), library.cpu_flash, cpu))
    flash_cpu = library.prompt_call(library.cpu_flash, ROW_BLOCK)
    reg(Candidate("library-flash-cpu", PROMPT_LAYOUTS, flash_cpu, cpu))
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


def merge(
    o_own: torch.Tensor, lse_own: torch.Tensor, o_pre: torch.Tensor, lse_pre: torch.Tensor
) -> torch.Tensor:
    """The attention over the union of two parts from each part's normalised float32 output
    (B, h, s, d) and log-sum-exp (B, h, s): o_own + w·(o_pre − o_own) with
    w = sigmoid(lse_pre − lse_own), the weight of the prompt part in the joint softmax."""
    batch, heads, s, _ = o_own.shape
    # Each row's weights are padded to a multiple of 64 lanes so that the vectorised sigmoid
    # treats every row alike: torch's CPU loop runs blocks of two vectors (32 floats with
    # AVX-512) and a scalar tail that rounds differently, so with rows of 16 lanes the last row
    # of an odd batch took the tail and the full control lost its bit-exactness.
    diff = (lse_pre - lse_own).reshape(batch, heads * s)
    diff = torch.nn.functional.pad(diff, (0, (-heads * s) % 64))
    weight = torch.sigmoid(diff)[:, : heads * s].reshape(batch, heads, s, 1)
    return o_own + weight * (o_pre - o_own)


def attend_own(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    fused: bool = True,
    native: bool = True,
    prompt: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``rows_own`` layout: (B, h, s, d) × (B, h, n, d) → float32 output and log-sum-exp
    (B, h, s), through the registry's kernel (``fused=False``: the reference; ``native=False``:
    no native kernel). ``prompt``: the prompt part's float32 output (B, h, s, d) and
    log-sum-exp (B, h, s); the output is then the attention over both parts (:func:`merge`),
    merged inside the kernel where it can (the native one), and the log-sum-exp stays the own
    part's."""
    while True:
        cand = registry.choose(
            "rows_own", q.device, q.dtype, q.shape[-1], fused=fused, native=native
        )
        if cand.oracle or not (q.numel() and k.numel()):  # (fused kernels may fault on empty)
            out, lse = math_attention(q, k, v, scale)
            break
        try:
            if prompt is not None and cand.run in _MERGING:
                return cand.run(q, k, v, scale, *prompt)
            out, lse = cand.run(q, k, v, scale)
            out, lse = out.float(), lse.float()
            break
        except _FAILURES as exc:
            registry.drop(cand, "rows_own", q.device, q.dtype, q.shape[-1], exc)
    if prompt is not None:
        out = merge(out, lse, *prompt)
    return out, lse


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
