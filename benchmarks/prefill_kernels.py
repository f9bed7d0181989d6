"""Benchmark: the prefill's causal attention on the CPU, per kernel choice, against the GEMM rate.

A prompt's prefill runs transformers' SDPA attention with ``is_causal=True`` in every layer
(SmolLM2: 9 query heads, 3 KV heads, d = 64). This prints, per prompt length, the useful
GFLOP/s of one layer's causal attention (n²/2 query–key pairs, 4·d each, per query head) and
its ratio to the 2048×576×1536 float32 GEMM measured before and after in the same process, one
thread, CPU time, for:

* ``gqa``: ``scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)``, what the
  prefill runs (transformers passes ``enable_gqa`` when there is no attention mask);
* ``repeated``: the same with the KV heads repeated to the query heads first (transformers'
  path when a mask is given);
* ``chunked c``: the queries in chunks of c positions, each chunk's attention split into the
  keys before it (no mask) and its own diagonal block (causal), both through the CPU flash
  kernel that returns the log-sum-exp, merged exactly — chunking as the issue proposes;
* ``math``: the plain product–softmax–product over the full n × n scores with a causal mask
  (twice the arithmetic; the path with no fused kernel).

Usage: ``python benchmarks/prefill_kernels.py [--lengths 4064 8064] [--chunks 512 1024]``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
GEMM = (2048, 576, 1536)
H_Q, H_KV, D = 9, 3, 64


def best(fn, rounds: int = 3) -> float:
    """The least CPU seconds of one call of ``fn`` over ``rounds`` calls (after a warm-up)."""
    fn()
    out = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        fn()
        out = min(out, time.process_time() - start)
    return out


def gemm_rate() -> float:
    m, k, n = GEMM
    a, b = torch.randn(m, k), torch.randn(k, n)
    return 2 * m * k * n * 10 / best(lambda: [a @ b for _ in range(10)], 5) / 1e9


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: int) -> torch.Tensor:
    """Causal attention of (1, H, n, d) tensors chunk by chunk, merged by log-sum-exp."""
    n, scale = q.shape[-2], q.shape[-1] ** -0.5
    outs = []
    for s in range(0, n, c):
        e = min(n, s + c)
        o_d, l_d = FLASH(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], 0.0, True, scale=scale)[:2]
        if s == 0:
            outs.append(o_d)
            continue
        o_p, l_p = FLASH(q[:, :, s:e], k[:, :, :s], v[:, :, :s], 0.0, False, scale=scale)[:2]
        w = torch.sigmoid(l_p - l_d)[..., None]
        outs.append(o_d + w * (o_p - o_d))
    return torch.cat(outs, dim=2)


def math_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    n = q.shape[-2]
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
    scores.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu_(1), float("-inf"))
    return scores.softmax(-1) @ v


def measure(n: int, chunks: list[int]) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, H_Q, n, D, generator=gen)
    k, v = (torch.randn(1, H_KV, n, D, generator=gen) for _ in range(2))
    rep_k, rep_v = (x.repeat_interleave(H_Q // H_KV, dim=1) for x in (k, v))
    flops = 4 * D * H_Q * n * (n + 1) / 2
    ref = F.scaled_dot_product_attention(q, rep_k, rep_v, is_causal=True)
    kernels = {
        "gqa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "repeated": lambda: F.scaled_dot_product_attention(q, rep_k, rep_v, is_causal=True),
    }
    for c in chunks:
        kernels[f"chunked {c}"] = lambda c=c: chunked(q, rep_k, rep_v, c)
    kernels["math"] = lambda: math_path(q, rep_k, rep_v)
    out = {}
    for name, fn in kernels.items():
        err = (fn() - ref).abs().max().item()
        if err > 1e-4:
            raise SystemExit(f"{name}: differs from SDPA by {err:.2e}")
        out[name] = flops / best(fn) / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4064, 8064])
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 1024])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, CPU time; GEMM {'×'.join(map(str, GEMM))} float32")
    print()
    rows = []
    for n in args.lengths:
        before = gemm_rate()
        rates = measure(n, args.chunks)
        after = gemm_rate()
        rows.append((n, before, after, rates))
    cols = list(rows[0][3])
    print("| n | GEMM GFLOP/s | " + " | ".join(cols) + " |")
    print("|---:|---:|" + "---:|" * len(cols))
    for n, before, after, rates in rows:
        g = (before + after) / 2
        flag = " ⚑" if abs(after - before) > 0.2 * min(after, before) else ""
        cells = " | ".join(f"{rates[c]:.0f} ({rates[c] / g:.0%})" for c in cols)
        print(f"| {n} | {before:.0f}–{after:.0f}{flag} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
