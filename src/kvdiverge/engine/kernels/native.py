"""The native prompt kernel: decoding rows' attention to a prompt cache, in C (AVX-512).

``prompt_attention.c`` (beside this file) computes, per KV head, the softmax attention of a
document's decoding queries over its prompt keys and values, each query row with its action's
additive mask, and the log-sum-exp that :mod:`kvdiverge.engine.attention` merges with the rows'
own entries. It reads each block of 64 prompt entries once for all the queries
(``docs/engine.md``, "The native prompt kernel").

It is used where :func:`unavailable` is ``None``: ``KVDIVERGE_NATIVE`` is not ``0``, this CPU
has AVX-512 (:func:`cpu_has_avx512`) and a C compiler builds it (:mod:`kvdiverge.engine.kernels.
build`: built on first use into the user's cache, verified before every load). Elsewhere
:func:`library` is ``None`` (one logged line) and the registry keeps the library kernels. The
first call's answer holds for the process (:func:`reset` forgets it).
:func:`attend` splits a call's KV heads and query rows over the threads torch is given
(ctypes releases the GIL during the call); every row is computed by the same instructions
wherever it falls, so any split gives the one-thread result bit for bit.

``own_attention.c``, in the same library, computes each decoding row's attention to its own
generated entries (:func:`attend_own`: the ``rows_own`` layout, read in place from the row
cache's views), and can merge it with the row's prompt part by their log-sum-exps in the same
pass; its rows are split over the threads alike.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.utils.weak import WeakIdKeyDictionary

from kvdiverge.engine.kernels import build

__all__ = [
    "BLOCK",
    "attend",
    "attend_own",
    "capability_has_avx512",
    "cpu_has_avx512",
    "library",
    "pack_keys",
    "reset",
    "unavailable",
    "work_items",
]

log = logging.getLogger(__name__)

BLOCK = 64  # keys per packed block (KB in the C source)
SOURCE = build.SOURCE
_SCORES_FLOATS = 1 << 18  # score rows held at once: 1 MiB, within a core's second-level cache
_PARALLEL_PAIRS = 1 << 17  # query-entry pairs below which a call runs on one thread (its
# work, about a millisecond, would not repay handing pieces to a pool)

_LIB: list[ctypes.CDLL | None] = []  # [] until tried, then [library or None]
_PACKED = WeakIdKeyDictionary()  # prompt keys → their packed copy
_LOCAL = threading.local()  # each thread's scratch buffer
_POOL: list[ThreadPoolExecutor] = []


def capability_has_avx512(capability: str) -> bool:
    """Whether a CPU capability string names AVX-512, in any of its forms (``AVX512``,
    ``avx512``, ``AVX512_BF16``, ``avx512f``, ``AVX-512``); ``AVX2``, ``DEFAULT``, ``NONE``,
    ``""`` and the rest do not."""
    cap = capability.strip().upper().replace("-", "").replace(" ", "")
    return cap.startswith("AVX512")


def _cpuinfo_flags(path: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def cpu_has_avx512() -> tuple[bool, str]:
    """Whether this CPU runs the kernel (AVX-512F and FMA), and where that was read:
    ``$KVDIVERGE_CPU_CAPABILITY`` when set (read like torch's capability: ``AVX2`` or ``none``
    makes it absent, for tests and machines that misreport), else the CPU's flags in
    ``/proc/cpuinfo`` (avx512f and fma), else torch's ``get_cpu_capability()``."""
    override = os.environ.get("KVDIVERGE_CPU_CAPABILITY")
    if override is not None:
        return capability_has_avx512(override), f"KVDIVERGE_CPU_CAPABILITY={override!r}"
    flags = _cpuinfo_flags()
    if flags is not None:
        return {"avx512f", "fma"} <= flags, "the CPU flags (avx512f, fma)"
    cap = str(torch.backends.cpu.get_cpu_capability())
    return capability_has_avx512(cap), f"torch's CPU capability {cap!r}"


def unavailable() -> str | None:
    """Why the native kernel cannot be used here (one phrase), or ``None``."""
    if os.environ.get("KVDIVERGE_NATIVE", "").strip() == "0":
        return "turned off by KVDIVERGE_NATIVE=0"
    has, source = cpu_has_avx512()
    if not has:
        return f"this CPU has no AVX-512 (read from {source})"
    if build.compiler_command() is None:
        return "no C compiler ($CC, cc, gcc)"
    return None


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built and verified on first call; ``None`` (one logged
    line) where :func:`unavailable` says why, or where it could not be built or loaded."""
    if _LIB:
        return _LIB[0]
    lib = None
    reason = unavailable()
    if reason is not None:
        log.info("native prompt kernel: %s; using the library kernels", reason)
    else:
        try:
            lib = build.load(build.compiler_command())
        except build.BuildError as exc:
            log.warning("native prompt kernel: not built (%s); using the library kernels", exc)
        if lib is not None:
            fn = lib.kvd_prompt_attention
            fn.restype = ctypes.c_int
            ptr = ctypes.c_void_p
            fn.argtypes = [ctypes.c_int] * 8 + [ptr] * 5 + [ctypes.c_float] + [ptr] * 3
            fn.argtypes += [ctypes.c_int]
            own = lib.kvd_own_attention
            own.restype = ctypes.c_int
            own.argtypes = [ctypes.c_int] * 7 + [ptr] * 3 + [ctypes.POINTER(ctypes.c_int64)]
            own.argtypes += [ctypes.c_float] + [ptr] * 5
    _LIB.append(lib)
    return lib


def reset() -> None:
    """Forget the loaded library, or why there was none: the next :func:`library` call reads
    ``KVDIVERGE_NATIVE``, the CPU capability and ``$CC`` again and builds or loads afresh
    (tests that change them; a process normally never resets)."""
    _LIB.clear()


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


def work_items(heads: int, rows: int, threads: int) -> list[tuple[int, int, int, int]]:
    """A call's (h0, h1, r0, r1) pieces for ``threads`` threads: one piece with one thread;
    else every KV head on its own, its rows split in ⌈threads / heads⌉ parts of whole 6-row
    tiles (so at least ``threads`` pieces when the rows allow)."""
    if threads <= 1 or heads * rows == 0:
        return [(0, heads, 0, rows)]
    parts = -(-threads // heads)
    step = max(6, -(-rows // parts))
    step = -(-step // 6) * 6
    return [(h, h + 1, r, min(rows, r + step)) for h in range(heads) for r in range(0, rows, step)]


def _scratch(floats: int) -> torch.Tensor:
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.numel() < floats:
        buf = torch.empty(floats, dtype=torch.float32)
        _LOCAL.buf = buf
    return buf


def _pool(threads: int) -> ThreadPoolExecutor:
    if not _POOL or _POOL[0]._max_workers != threads:
        if _POOL:
            _POOL.pop().shutdown(wait=False)
        _POOL.append(ThreadPoolExecutor(threads, thread_name_prefix="kvd-native"))
    return _POOL[0]


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
    row_bias: torch.Tensor | None = None,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q (H_kv, M, d) over keys, values (H_kv, n, d), float32 CPU:
    normalised output (H_kv, M, d) and log-sum-exp (H_kv, M).

    ``bias`` (n_bias, H_kv, n) additive (−inf drops an entry), ``row_bias`` (M,): each query
    row's index into it, −1 for none. A row with every entry dropped, and every row of an empty
    prompt part (n = 0), gets output 0 and log-sum-exp −inf. ``threads`` share the work
    (:func:`work_items`; default: torch's thread count, one for a call of fewer than
    ``_PARALLEL_PAIRS`` query-entry pairs); the result does not depend on them.
    Raises ``RuntimeError`` when the library is absent or refuses the shape, ``ValueError``
    for a bias without a row index per query.
    """
    lib = library()
    if lib is None:
        raise RuntimeError("native prompt kernel: not available")
    h, m, d = q.shape
    n = keys.shape[-2]
    if bias is not None and (row_bias is None or row_bias.numel() != m):
        raise ValueError(f"native prompt kernel: row_bias must give each of the {m} rows")
    if n == 0 or m == 0 or h == 0:  # nothing to attend to: every row keeps nothing
        if d % 16 or d > 128:
            raise RuntimeError(f"native prompt kernel: head size {d} not supported")
        return q.new_zeros((h, m, d)), q.new_full((h, m), float("-inf"))
    out = q.new_empty((h, m, d))
    lse = q.new_empty((h, m))
    q = q.contiguous()
    values = values.contiguous()
    packed = pack_keys(keys)
    width = packed.shape[1] * BLOCK
    chunk = max(1, min(m, _SCORES_FLOATS // width))
    if bias is not None:
        bias = bias.contiguous()
        row_bias = row_bias.to(torch.int32).contiguous()
    args = (
        q.data_ptr(),
        packed.data_ptr(),
        values.data_ptr(),
        None if bias is None else bias.data_ptr(),
        None if bias is None else row_bias.data_ptr(),
        float(scale),
        out.data_ptr(),
        lse.data_ptr(),
    )

    def piece(item: tuple[int, int, int, int]) -> int:
        scratch = _scratch(chunk * width + chunk)
        return lib.kvd_prompt_attention(h, m, n, d, *item, *args, scratch.data_ptr(), chunk)

    if threads is None:
        threads = torch.get_num_threads() if h * m * n >= _PARALLEL_PAIRS else 1
    items = work_items(h, m, threads)
    if len(items) == 1:
        codes = [piece(items[0])]
    else:
        codes = list(_pool(min(threads, len(items))).map(piece, items))
    if any(codes):
        raise RuntimeError(f"native prompt kernel: head size {d} not supported")
    return out, lse


def attend_own(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    o_pre: torch.Tensor | None = None,
    lse_pre: torch.Tensor | None = None,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's attention to its own entries (``own_attention.c``), float32 CPU: q
    (B, H_kv, G, d) over keys, values (B, H_kv, t, d), any strides with unit stride along d
    (the row cache's views are read in place): output (B, H_kv, G, d) and log-sum-exp
    (B, H_kv, G), contiguous, out = softmax(scale·q·kᵀ)·v and lse = log Σ_j exp(scale·q·k_j).

    With the prompt part's output ``o_pre`` (B, H_kv, G, d) and log-sum-exp ``lse_pre``
    (B, H_kv, G), any strides (views of the prompt kernels' (H_kv, B, G, …) buffers are read in
    place), the output is the attention over both parts instead, o + w·(o_pre − o) with
    w = sigmoid(lse_pre − lse) (the log-sum-exp returned stays the own part's). With no entry
    (t = 0) the output is 0 (merged: ``o_pre``) and the log-sum-exp −inf. ``threads`` share the
    rows (default: torch's thread count, one for a call of fewer than ``_PARALLEL_PAIRS``
    query-entry pairs); the result does not depend on them, nor a row's on its batch.
    Raises ``RuntimeError`` when the library is absent or refuses the head size, ``ValueError``
    for inputs that are not float32 CPU tensors of matching shapes.
    """
    lib = library()
    if lib is None:
        raise RuntimeError("native own kernel: not available")
    b, h, g, d = q.shape
    t = keys.shape[-2]
    if keys.shape != (b, h, t, d) or values.shape != keys.shape:
        raise ValueError(
            f"native own kernel: keys and values must be (B, H_kv, t, d) = ({b}, {h}, t, {d}), "
            f"got {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    merged = (o_pre, lse_pre)
    tensors = (q, keys, values, *(x for x in merged if x is not None))
    if any(x.dtype != torch.float32 or x.device.type != "cpu" for x in tensors):
        raise ValueError("native own kernel: every input must be a float32 CPU tensor")
    if (o_pre is None) != (lse_pre is None):
        raise ValueError("native own kernel: o_pre and lse_pre come together")
    if o_pre is not None and (o_pre.shape != q.shape or lse_pre.shape != q.shape[:3]):
        raise ValueError(
            f"native own kernel: o_pre must be {tuple(q.shape)} and lse_pre "
            f"{tuple(q.shape[:3])}, got {tuple(o_pre.shape)} and {tuple(lse_pre.shape)}"
        )
    if d % 16 or not 0 < d <= 128:
        raise RuntimeError(f"native own kernel: head size {d} not supported")
    out = q.new_empty((b, h, g, d))
    lse = q.new_empty((b, h, g))
    if b * h * g == 0:
        return out, lse
    q, keys, values = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, keys, values))
    strides = [*q.stride()[:3], *keys.stride()[:3], *values.stride()[:3]]
    if o_pre is not None:
        o_pre = o_pre if o_pre.stride(-1) == 1 else o_pre.contiguous()
        strides += [*o_pre.stride()[:3], *lse_pre.stride()]
    strides = (ctypes.c_int64 * 15)(*strides)
    ld = -(-t // 16) * 16
    args = (
        q.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        strides,
        float(scale),
        None if o_pre is None else o_pre.data_ptr(),
        None if lse_pre is None else lse_pre.data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
    )

    def piece(rows: tuple[int, int]) -> int:
        scratch = _scratch(g * ld + 2 * g)
        return lib.kvd_own_attention(b, h, g, t, d, *rows, *args, scratch.data_ptr())

    if threads is None:
        threads = torch.get_num_threads() if b * h * g * t >= _PARALLEL_PAIRS else 1
    step = -(-b // max(1, min(threads, b)))
    items = [(r, min(b, r + step)) for r in range(0, b, step)]
    if len(items) == 1:
        codes = [piece(items[0])]
    else:
        codes = list(_pool(threads).map(piece, items))
    if any(codes):
        raise RuntimeError(f"native own kernel: head size {d} not supported")
    return out, lse
