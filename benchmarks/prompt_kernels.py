"""Benchmark: what bounds a decoding call's prompt attention on the CPU, against the GEMM rate.

A document's decoding rows give Q = rows × G queries per KV head (G = 3 for SmolLM2) against
its n prompt entries; in a rollout job Q is a few dozen (a K = 4 document: about 9 rows in its
prompt pass, ``benchmarks/README.md``, "Prompt attention kernels"). This prints, per (n, Q),
useful GFLOP/s (4·d per query–entry pair) and their ratio to the 2048×576×1536 float32 GEMM
measured in the same process, one thread, CPU time (``time.process_time``: the rate of the
thread while it ran, so that another process on the machine costs less of the measurement):

* ``flash hot``: the CPU flash kernel the engine uses (``aten::_scaled_dot_product_flash_
  attention_for_cpu``) on one layer's keys and values, again and again (they stay in cache);
* ``flash cold``: the same over 30 layers × 4 documents of distinct keys and values, as in a
  decoding step (every layer's prompt cache comes from memory);
* ``products cold``: the two matrix products alone (scores = q·Kᵀ, then W·V with W the scores),
  over the same cold caches: the arithmetic an attention kernel cannot avoid, at the matrix
  rate of these shapes;
* ``whole cold``: a kernel made of those two products with the softmax between them in
  elementwise passes (max, subtract, clamp at −87 so that ``exp`` stays on its fast path,
  ``exp``, sum), the alternative to the flash kernel measured for issue 29;
* ``masked 50%``: the flash kernel, cold, with half of every row's entries masked out by an
  additive −inf mask (the masked prompt pass of a half-budget action);
* ``native hot`` / ``native cold``: the engine's native prompt kernel
  (``kvdiverge.engine.kernels.native``, keys packed once per cache as the engine does), as the flash
  kernel above; ``native masked 50%``: cold, half of every row's entries masked by its row's
  (H_kv, n) bias (the form the engine passes);
* ``read K, V``: one summing pass over the cold keys and values (the memory's own rate: the
  floor of any kernel that reads them).

With ``--threads 1 2`` it prints instead, per (n, Q) and thread count, the wall-clock
milliseconds per layer and document, cold, of the flash kernel, the native kernel and the native
kernel masked 50% (the native kernel splits its KV heads and rows over torch's threads; its
results are the same bits on any count), and each one's speed-up over its one-thread time. Wall
time, not CPU time: several threads share the call. On a loaded machine these are upper bounds.

With ``--own`` it prints instead, per batch of B decoding rows and own-entry count t, the
milliseconds (one thread, CPU time) per layer call of the ``rows_own`` layout on SmolLM2's
shapes (3 KV heads × G = 3 query heads, d = 64), over 30 layers of distinct row caches (each a
(B, H_kv, capacity, d) buffer read through its [:B, :, :t] views, as the engine reads it):

* ``flash``: the CPU flash kernel (``library-flash-cpu``); ``torch merge``: the log-sum-exp
  merge with the prompt part in torch (``kvdiverge.engine.kernels.dispatch.merge``);
  ``flash + merge``: both through ``dispatch.attend_own`` with ``native=False``, the engine's
  path before the native kernel;
* ``native``: ``kvdiverge.engine.kernels.native.attend_own``; ``native merged``: the engine's
  path now, ``dispatch.attend_own`` with the prompt part merged inside the kernel;
* ``read K, V``: one summing pass over the views (the floor of any kernel that reads them).

Usage: ``python benchmarks/prompt_kernels.py [--lengths 4064 8064] [--queries 27 81 243]
[--threads 1 2] [--own [--rows 97] [--entries 64 128]]``.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvdiverge.engine.kernels import dispatch, library, native

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
GEMM = (2048, 576, 1536)
H_KV, D, LAYERS, DOCS = 3, 64, 30, 4


def best(fn, rounds: int = 3, reps: int = 1) -> float:
    """The least CPU seconds per call of ``fn`` over ``rounds`` rounds of ``reps`` calls."""
    fn()
    out = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(reps):
            fn()
        out = min(out, (time.process_time() - start) / reps)
    return out


def gemm_rate() -> float:
    m, k, n = GEMM
    a, b = torch.randn(m, k), torch.randn(k, n)
    return 2 * m * k * n / best(lambda: a @ b, 5, 10) / 1e9


def whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    s = torch.bmm(q * scale, k.transpose(1, 2))
    m = s.amax(-1, keepdim=True)
    s.sub_(m).clamp_min_(-87.0).exp_()
    total = s.sum(-1, keepdim=True)
    return torch.bmm(s, v).div_(total), m + total.log()


def measure(n: int, n_q: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    caches = [
        (torch.randn(H_KV, n, D, generator=gen), torch.randn(H_KV, n, D, generator=gen))
        for _ in range(LAYERS * DOCS)
    ]
    q = torch.randn(H_KV, n_q, D, generator=gen)
    drop = torch.rand(H_KV, 1, n, generator=gen) < 0.5
    bias = torch.zeros(H_KV, n_q, n).masked_fill_(drop, float("-inf"))
    scale = D**-0.5
    k0, v0 = caches[0]
    flops = 4 * H_KV * n_q * n * D

    def cold(fn):
        return lambda: [fn(k, v) for k, v in caches]

    def flash(k, v, mask=None):
        return FLASH(q[None], k[None], v[None], 0.0, False, attn_mask=mask, scale=scale)

    for k, _ in caches:  # packed once per cache (memoised), as in the engine
        native.pack_keys(k)
    if native.library() is None:
        raise SystemExit("the native prompt kernel is not built on this machine")
    row_bias = torch.zeros(n_q, dtype=torch.int32)
    half = bias[:, :1].clone()[None, :, 0]  # (1, H_KV, n): one row's mask

    def nat(k, v, masked=False):
        if masked:
            return native.attend(q, k, v, scale, half, row_bias)
        return native.attend(q, k, v, scale)

    each = len(caches)
    times = {
        "flash hot": best(lambda: flash(k0, v0), 5, 20),
        "flash cold": best(cold(flash)) / each,
        "products cold": best(cold(lambda k, v: torch.bmm(torch.bmm(q, k.transpose(1, 2)), v)))
        / each,
        "whole cold": best(cold(lambda k, v: whole(q, k, v, scale))) / each,
        "masked 50%": best(cold(lambda k, v: flash(k, v, bias[None]))) / each,
        "native hot": best(lambda: nat(k0, v0), 5, 20),
        "native cold": best(cold(nat)) / each,
        "native masked 50%": best(cold(lambda k, v: nat(k, v, True))) / each,
        "read K, V": best(cold(lambda k, v: (k.sum(), v.sum()))) / each,
    }
    return {name: flops / t / 1e9 for name, t in times.items()}


def best_wall(fn, rounds: int = 3) -> float:
    """The least wall-clock seconds of ``fn`` over ``rounds`` calls (after one warm-up)."""
    fn()
    out = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - start)
    return out


def thread_times(n: int, n_q: int, threads: int) -> dict[str, float]:
    """Wall milliseconds per layer and document, cold, on ``threads`` torch threads."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    caches = [
        (torch.randn(H_KV, n, D, generator=gen), torch.randn(H_KV, n, D, generator=gen))
        for _ in range(LAYERS * DOCS)
    ]
    q = torch.randn(H_KV, n_q, D, generator=gen)
    for k, _ in caches:
        native.pack_keys(k)
    drop = torch.rand(1, H_KV, n, generator=gen) < 0.5
    half = torch.zeros(1, H_KV, n).masked_fill_(drop, float("-inf"))
    row_bias = torch.zeros(n_q, dtype=torch.int32)
    scale = D**-0.5

    def cold(fn):
        return lambda: [fn(k, v) for k, v in caches]

    def flash(k, v):
        return FLASH(q[None], k[None], v[None], 0.0, False, attn_mask=None, scale=scale)

    each = len(caches) / 1e3
    return {
        "read K, V": best_wall(cold(lambda k, v: (k.sum(), v.sum()))) / each,
        "flash cold": best_wall(cold(flash)) / each,
        "native cold": best_wall(cold(lambda k, v: native.attend(q, k, v, scale))) / each,
        "native masked 50%": best_wall(
            cold(lambda k, v: native.attend(q, k, v, scale, half, row_bias))
        )
        / each,
    }


def gemm_wall_rate(threads: int) -> float:
    """The GEMM's GFLOP/s on ``threads`` torch threads, wall clock (the threads share it)."""
    torch.set_num_threads(threads)
    m, k, n = GEMM
    a, b = torch.randn(m, k), torch.randn(k, n)
    return 2 * m * k * n / best_wall(lambda: a @ b, 10) / 1e9


def thread_table(lengths: list[int], queries: list[int], counts: list[int]) -> None:
    """Per (n, Q) and thread count: each kernel's wall ms and speed-up over its first count,
    beside the GEMM's own rate at that count, measured just before and after the row (the
    yardstick: a second thread that gives the GEMM little gives a kernel little)."""
    if native.library() is None:
        raise SystemExit("the native prompt kernel is not built on this machine")
    cols = ("read K, V", "flash cold", "native cold", "native masked 50%")
    print(f"torch {torch.__version__}, wall-clock ms per layer and document (cold)")
    print()
    print(
        "| n | Q per KV head | threads | GEMM GFLOP/s (before–after) | " + " | ".join(cols) + " |"
    )
    print("|---:|---:|---:|---:|" + "---:|" * len(cols))
    for n in lengths:
        for n_q in queries:
            one = None
            for threads in counts:
                before = gemm_wall_rate(threads)
                times = thread_times(n, n_q, threads)
                after = gemm_wall_rate(threads)
                one = one or times
                cells = " | ".join(f"{times[c]:.3f} ({one[c] / times[c]:.2f}×)" for c in cols)
                rates = f"{before:.0f}–{after:.0f}"
                print(f"| {n} | {n_q} | {threads} | {rates} | {cells} |", flush=True)
    torch.set_num_threads(1)


def own_times(rows: int, t: int, capacity: int = 128, groups: int = 3) -> dict[str, float]:
    """CPU milliseconds per layer call of the ``rows_own`` kernels (``--own``), one thread."""
    gen = torch.Generator().manual_seed(0)
    capacity = max(capacity, t)
    shape = (rows, H_KV, capacity, D)
    caches = [
        (torch.randn(shape, generator=gen)[:, :, :t], torch.randn(shape, generator=gen)[:, :, :t])
        for _ in range(LAYERS)
    ]
    query = torch.randn(rows, 1, H_KV * groups, D, generator=gen).transpose(1, 2)
    q = query.reshape(rows, H_KV, groups, D)  # as the attention function folds the heads
    o_pre = torch.randn(rows, H_KV, groups, D, generator=gen)
    lse_pre = torch.randn(rows, H_KV, groups, generator=gen) + 5
    scale = D**-0.5

    def flash(k, v):
        out, lse = library.cpu_flash(q, k, v, scale)
        return out.float(), lse.float()

    def engine(native_kernel):  # the call the attention function makes
        return lambda k, v: dispatch.attend_own(
            q, k, v, scale, native=native_kernel, prompt=(o_pre, lse_pre)
        )

    o_own, lse_own = flash(*caches[0])

    def cold(fn):
        return lambda: [fn(k, v) for k, v in caches]

    each = LAYERS / 1e3
    return {
        "flash": best(cold(flash)) / each,
        "torch merge": best(cold(lambda k, v: dispatch.merge(o_own, lse_own, o_pre, lse_pre)))
        / each,
        "flash + merge": best(cold(engine(False))) / each,
        "native": best(cold(lambda k, v: native.attend_own(q, k, v, scale))) / each,
        "native merged": best(cold(engine(True))) / each,
        "read K, V": best(cold(lambda k, v: (k.sum(), v.sum()))) / each,
    }


def own_table(batches: list[int], entries: list[int]) -> None:
    """``--own``: per (B, t), each ``rows_own`` path's ms per layer call and the new path's
    speed-up over the old (flash + merge → native merged)."""
    if native.library() is None:
        raise SystemExit("the native kernels are not built on this machine")
    torch.set_num_threads(1)
    cols = ("flash", "torch merge", "flash + merge", "native", "native merged", "read K, V")
    print(f"torch {torch.__version__}, 1 thread, CPU ms per layer call (30 layers' row caches)")
    print()
    print("| B | t | " + " | ".join(cols) + " | speed-up |")
    print("|---:|---:|" + "---:|" * len(cols) + "---:|")
    for rows in batches:
        for t in entries:
            ms = own_times(rows, t)
            cells = " | ".join(f"{ms[c]:.3f}" for c in cols)
            gain = ms["flash + merge"] / ms["native merged"]
            print(f"| {rows} | {t} | {cells} | {gain:.1f}× |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4064, 8064])
    parser.add_argument("--queries", type=int, nargs="+", default=[27, 81, 243])
    parser.add_argument(
        "--threads", type=int, nargs="+", help="the thread table instead (e.g. 1 2)"
    )
    parser.add_argument(
        "--own", action="store_true", help="the rows_own table instead (--rows, --entries)"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[97])
    parser.add_argument("--entries", type=int, nargs="+", default=[64, 128])
    args = parser.parse_args()
    if args.own:
        own_table(args.rows, args.entries)
        return
    if args.threads:
        thread_table(args.lengths, args.queries, args.threads)
        return
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, CPU time; GEMM {'×'.join(map(str, GEMM))} float32")
    print()
    cols = (
        "flash hot",
        "flash cold",
        "products cold",
        "whole cold",
        "masked 50%",
        "native hot",
        "native cold",
        "native masked 50%",
        "read K, V",
    )
    print("| n | Q per KV head | GEMM GFLOP/s | " + " | ".join(cols) + " |")
    print("|---:|---:|---:|" + "---:|" * len(cols))
    for n in args.lengths:
        for n_q in args.queries:
            before = gemm_rate()
            rates = measure(n, n_q)
            after = gemm_rate()
            g = (before + after) / 2
            flag = " ⚑" if abs(after - before) > 0.2 * min(after, before) else ""
            cells = " | ".join(f"{rates[c]:.0f} ({rates[c] / g:.0%})" for c in cols)
            print(f"| {n} | {n_q} | {before:.0f}–{after:.0f}{flag} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
