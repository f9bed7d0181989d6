"""The native prompt kernel: decoding rows' attention to a prompt cache, compiled on first use.

``prompt_attention.c`` (beside this file) computes, per KV head, the softmax attention of a
document's decoding queries over its prompt keys and values, each query row with its action's
additive mask, and the log-sum-exp that :mod:`kvdiverge.engine.attention` merges with the rows'
own entries. It reads each block of 64 prompt entries once for all the queries; the library
kernels, at the few dozen queries per KV head of a decoding pass, run at a third of the matrix
rate (``docs/engine.md``, "The native prompt kernel"; ``benchmarks/README.md``, "Native prompt
kernel"). It needs AVX-512 (as torch reports it) and a C compiler (``$CC``, else ``cc``); the
shared library is built once per source, compiler and flags into ``$KVDIVERGE_CACHE``
(default ``~/.cache/kvdiverge``) by an atomic rename, so concurrent jobs can share it. Where
either is missing :func:`library` is ``None`` and the engine keeps the library kernels.

This module only builds, loads and calls the kernel; :mod:`kvdiverge.engine.attention` checks
it against its plain float32 path before any use (``_native_agrees``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["BLOCK", "attend", "library", "pack_keys"]

log = logging.getLogger(__name__)

BLOCK = 64  # keys per packed block (KB in the C source)
SOURCE = Path(__file__).with_name("prompt_attention.c")
FLAGS = ("-O3", "-mavx512f", "-mfma", "-fPIC", "-shared")
_SCORES_FLOATS = 1 << 18  # score rows held at once: 1 MiB, within a core's second-level cache

_LIB: list[ctypes.CDLL | None] = []  # [] until tried, then [library or None]
_PACKED = WeakIdKeyDictionary()  # prompt keys → their packed copy


def _cache_dir() -> Path:
    root = os.environ.get("KVDIVERGE_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvdiverge"


def _build(compiler: str) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    digest = hashlib.sha256(
        SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"prompt_attention-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; ``None`` (once logged) where this CPU
    lacks AVX-512 or no C compiler builds it."""
    if _LIB:
        return _LIB[0]
    lib = None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        log.info("native prompt kernel: this CPU has no AVX-512; using the library kernels")
    elif compiler is None:
        log.info("native prompt kernel: no C compiler ($CC, cc); using the library kernels")
    else:
        try:
            lib = ctypes.CDLL(str(_build(compiler)))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            log.warning("native prompt kernel: not built (%s); using the library kernels", detail)
            lib = None
        if lib is not None:
            fn = lib.kvd_prompt_attention
            fn.restype = ctypes.c_int
            ptr = ctypes.c_void_p
            fn.argtypes = [ctypes.c_int] * 4 + [ptr] * 5 + [ctypes.c_float] + [ptr] * 3
            fn.argtypes += [ctypes.c_int]
    _LIB.append(lib)
    return lib


def pack_keys(keys: torch.Tensor) -> torch.Tensor:
    """(H_kv, n, d) keys → the kernel's layout (H_kv, ⌈n/64⌉, d, 64): block b holds entries
    64b … 64b + 63 transposed, zero past n. Memoised per keys tensor (the prompt's keys are
    constant while its rows decode); the copy is freed with the keys."""
    packed = _PACKED.get(keys)
    if packed is None:
        h, n, d = keys.shape
        blocks = -(-n // BLOCK)
        padded = keys.new_zeros((h, blocks * BLOCK, d))
        padded[:, :n] = keys
        packed = padded.view(h, blocks, BLOCK, d).transpose(-1, -2).contiguous()
        _PACKED[keys] = packed
    return packed


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
    row_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q (H_kv, M, d) over keys, values (H_kv, n, d), float32 CPU:
    normalised output (H_kv, M, d) and log-sum-exp (H_kv, M).

    ``bias`` (n_bias, H_kv, n) additive (−inf drops an entry), ``row_bias`` (M,) int32: each
    query row's index into it, −1 for none. A row with every entry dropped gets output 0 and
    log-sum-exp −inf. Raises ``RuntimeError`` when the library is absent or refuses the shape.
    """
    lib = library()
    if lib is None:
        raise RuntimeError("native prompt kernel: not available")
    h, m, d = q.shape
    n = keys.shape[-2]
    q = q.contiguous()
    values = values.contiguous()
    packed = pack_keys(keys)
    width = packed.shape[1] * BLOCK
    chunk = max(1, min(m, _SCORES_FLOATS // width))
    out = q.new_empty((h, m, d))
    lse = q.new_empty((h, m))
    scratch = q.new_empty(chunk * width + chunk)
    if bias is not None:
        if row_bias is None or row_bias.numel() != m:
            raise ValueError(f"native prompt kernel: row_bias must give each of the {m} rows")
        bias = bias.contiguous()
        row_bias = row_bias.to(torch.int32).contiguous()
    code = lib.kvd_prompt_attention(
        h,
        m,
        n,
        d,
        q.data_ptr(),
        packed.data_ptr(),
        values.data_ptr(),
        None if bias is None else bias.data_ptr(),
        None if bias is None else row_bias.data_ptr(),
        float(scale),
        out.data_ptr(),
        lse.data_ptr(),
        scratch.data_ptr(),
        chunk,
    )
    if code != 0:
        raise RuntimeError(f"native prompt kernel: head size {d} not supported")
    return out, lse
