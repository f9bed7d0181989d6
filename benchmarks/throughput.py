"""Benchmark: the rollout engine's throughput against the machine's own peak, in one process.

For a model (SmolLM2-135M-Instruct, the tiny Llama demo model) and a job shape (the default's:
study 1's four actions, K = 3, K_dev = K_control = 2, H = 32, two development and two
evaluation documents of ~768 tokens; the CPU study's: K = 4, prompts of 1K/2K/4K tokens, two
development and three evaluation documents), it runs one rollout job's documents through
``kvdiverge.engine.batches.batched_paths`` (the rows of several documents in each model call)
and
reports, side by side with the big-GEMM rate measured in the same process just before and after
(a 2048×576×1536 float32 matmul, the model's MLP shape):

* decode row-steps/s and the model arithmetic it achieved: the matrix products of every
  decoding call counted exactly (every linear layer and the LM head per row, attention 4·d per
  attended entry per query head and layer: the row's prompt part and its own entries), over the
  decode wall time (coupling, float64 softmax and bookkeeping included), and its ratio to the
  GEMM rate;
* prefill tokens/s and its model GFLOP/s (causal attention counted as n²/2 pairs), and ratio;
* where the decode time goes: the model calls' attention blocks (projections included; the
  shared-prefix attention itself apart), MLPs, LM head, the rest of the calls, and the time
  outside the model calls (coupling, float64 softmax, EOS handling, row bookkeeping);
* the speed-up over the per-replicate transformers baseline of ``benchmarks/rollout.py``
  (batch-1 forwards over per-replicate cache copies, the same coupling), seconds per coupled
  path of H steps: the baseline's on the job's first document for SnapKV-half at K, against
  the job's decode seconds over all its paths.

The machine is shared, so every ratio is taken against GEMM rates measured in the same process
next to it; a ratio with GEMM rates that differ by more than 20% before and after is flagged.

Usage::

    python benchmarks/throughput.py                       # both models, both shapes
    python benchmarks/throughput.py --models smollm2 --shapes cpu-study --lengths 2048
    python benchmarks/throughput.py --sweep 48 96 192 384  # decode rate per row budget
    # configs/compression.yaml's kinds of action (a selection, a quantized prompt, with its
    # generated entries quantized too, compression during decoding: streaming and kvpress's
    # DecodingPress), each beside the control:
    python benchmarks/throughput.py --models smollm2 --shapes compression --threads 1
    # the replication's shapes (H = 128, 4K and 8K prompts, study 1's and study 2's actions),
    # today's gathered prompt attention beside the chosen layout:
    python benchmarks/throughput.py --models smollm2 --shapes study1 study2 --lengths 4096 8192 \
        --H 128 --layouts gathered auto --threads 1
    # the native prompt kernel beside the library kernels, one after the other in one process:
    python benchmarks/throughput.py --models smollm2 --shapes study1 --lengths 4096 \
        --H 128 --kernels native library --threads 1
    # the roofline (benchmarks/roofline.py): every part of decode and prefill against its
    # bound, for the default's job, study 1 at 4K and study 2 at 8K (H = 128, whole strata):
    python benchmarks/throughput.py --models smollm2 --roofline --no-baseline --threads 1

Every ratio is printed with the GEMM rate it was taken against (the mean of the rates measured
before and after the job, and after the baseline) and a flag ("GEMM moved") when those rates
differ by more than 20%: such a ratio was taken on a machine loaded by other work and is not a
result.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import roofline  # noqa: E402

import kvdiverge.engine.attention as attention  # noqa: E402
import kvdiverge.engine.rows as decode  # noqa: E402
from kvdiverge.engine import RolloutSettings, batched_paths  # noqa: E402
from kvdiverge.eviction import parse_action, run_prefill  # noqa: E402
from kvdiverge.models import chat_prompt_ids, eos_token_ids, load_model, load_tokenizer  # noqa: E402

MODELS = {"smollm2": ROOT / "data/models/smollm2", "tiny": ROOT / "data/models/tiny-llama"}
ACTIONS = [
    parse_action({"selector": "snapkv", "budget": 512}, name="snapkv-512"),
    parse_action({"selector": "snapkv", "budget": 0.5}, name="snapkv-half"),
    parse_action({"selector": "recent", "budget": 0.5}, name="recent-half"),
    parse_action({"selector": "full"}, name="full"),
]
# configs/cpu-study.yaml's study 2 (with the control)
STUDY2_ACTIONS = [
    parse_action({"selector": "snapkv", "budget": 0.9}, name="snapkv-90"),
    parse_action({"selector": "recent", "budget": 0.9}, name="recent-90"),
    parse_action({"selector": "full"}, name="full"),
]
# configs/compression.yaml's kinds of action, each beside the control in a job of its own
# (--shapes compression): prompt selection, prompt transformation, compression during decoding
_FULL = parse_action({"selector": "full"}, name="full")
COMPRESSION_KINDS = {
    "selection (snapkv-24)": parse_action({"selector": "snapkv", "budget": 0.24}, name="snapkv-24"),
    "transformation (kivi-4bit)": parse_action(
        {"selector": "quantize", "bits": 4, "group_size": 32, "residual": 32}, name="kivi-4bit"
    ),
    "transformation, generated too (kivi-2bit-gen)": parse_action(
        {"selector": "quantize", "bits": 2, "group_size": 32, "residual": 0, "generated": True},
        name="kivi-2bit-gen",
    ),
    "transformation, merged (merging-24)": parse_action(
        {
            "selector": "kvpress",
            "press": "MergingPress",
            "budget": 0.24,
            "press_kwargs": {
                "press": "SnapKVPress",
                "similarity_threshold": 0.0,
                "merge_fraction": 1.0,
            },
        },
        name="merging-24",
    ),
    "transformation, transformers' cache (quanto-4bit)": parse_action(
        {"selector": "quantized-cache", "backend": "quanto", "nbits": 4}, name="quanto-4bit"
    ),
    "decoding (streaming-192)": parse_action(
        {"selector": "streaming", "sinks": 4, "window": 188}, name="streaming-192"
    ),
    "decoding (decoding-knorm)": parse_action(
        {
            "selector": "kvpress",
            "press": "DecodingPress",
            "press_kwargs": {
                "base_press": "KnormPress",
                "compression_interval": 8,
                "target_size": 192,
            },
        },
        name="decoding-knorm",
    ),
}
GEMM = (2048, 576, 1536)


@dataclass(frozen=True)
class Shape:
    """A rollout job's shape: prompt tokens, H, and per document the replicates per action."""

    name: str
    n: int
    H: int
    counts: tuple[dict[str, int], ...]
    actions: tuple = tuple(ACTIONS)


def job_counts(
    k: int, k_dev: int, k_control: int, n_dev: int, n_eval: int, actions: Sequence = ACTIONS
) -> tuple[dict, ...]:
    """Per document {action: K}: the development documents at K_dev, the evaluation ones at
    K, the control at K_control on both (``config.yaml``'s study 1 by default)."""
    dev = {a.name: (k_control if a.name == "full" else k_dev) for a in actions}
    ev = {a.name: (k_control if a.name == "full" else k) for a in actions}
    return tuple([dev] * n_dev + [ev] * n_eval)


def shapes(
    names: Sequence[str],
    lengths: Sequence[int],
    H: int,
    docs: tuple[int, int] = (2, 3),
    K: int = 4,
) -> list[Shape]:
    out = []
    if "default" in names:  # config.yaml: 768-token strata, 2 dev + 2 study1 documents
        out.append(Shape("default", 768 - H, H, job_counts(3, 2, 2, 2, 2)))
    if "compression" in names:  # configs/compression.yaml's kinds, each with the control
        for kind, action in COMPRESSION_KINDS.items():
            acts = (action, _FULL)
            counts = job_counts(3, 2, 2, 2, 2, acts)
            out.append(Shape(f"compression: {kind}", 768 - H, H, counts, acts))
    if "cpu-study" in names:  # configs/cpu-study.yaml: 2 dev + 3 study1 documents per stratum
        for n in lengths:
            out.append(Shape(f"cpu-study {n // 1024}K", n - H, H, job_counts(4, 2, 2, 2, 3)))
    # the replication's jobs (configs/cpu-study.yaml's studies at the given H and lengths): one
    # stratum's development + evaluation documents (``docs``: 2 + 3), K (4), K_dev = K_control = 2
    for study, actions in (("study1", ACTIONS), ("study2", STUDY2_ACTIONS)):
        if study in names:
            for n in lengths:
                counts = job_counts(K, 2, 2, *docs, actions)
                name = f"{study} {n // 1024}K H={H} K={K} ({docs[0]} dev + {docs[1]} eval docs)"
                out.append(Shape(name, n - H, H, counts, tuple(actions)))
    return out


def clock() -> float:
    """``time.perf_counter()`` once the queued CUDA work is done (CUDA is asynchronous)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def gemm_rate(model: torch.nn.Module, seconds: float = 1.0) -> float:
    """GFLOP/s of the big GEMM in this process, on the model's device and in its dtype (best
    of three timed runs)."""
    m, k, n = GEMM
    gen = torch.Generator().manual_seed(0)
    weight = next(model.parameters())
    a, b = (torch.randn(shape, generator=gen).to(weight) for shape in ((m, k), (k, n)))
    torch.mm(a, b)
    start = clock()
    reps = 0
    while clock() - start < seconds / 3 or reps < 2:
        torch.mm(a, b)
        reps += 1
    best = float("inf")
    for _ in range(3):
        start = clock()
        for _ in range(reps):
            torch.mm(a, b)
        best = min(best, (clock() - start) / reps)
    return 2 * m * k * n / best / 1e9


def essay_text() -> str:
    return "\n\n".join(p.read_text() for p in sorted((ROOT / "data/fixtures/essays").glob("*.txt")))


def document_prompts(tokenizer, n: int, count: int) -> list[list[int]]:
    """``count`` chat-wrapped prompts of at most ``n`` tokens (the most essay words that fit),
    each from another essay offset."""
    words = essay_text().split()
    question = "\nAnswer briefly: what is the text about?"

    def wrapped(start: int, m: int) -> list[int]:
        chosen = [words[(start + i) % len(words)] for i in range(m)]
        return chat_prompt_ids(tokenizer, " ".join(chosen) + question)

    out = []
    for i in range(count):
        start = (i * 997) % len(words)
        low, high = 1, 4 * n  # the most words whose wrapped prompt fits
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if len(wrapped(start, mid)) <= n else (low, mid - 1)
        out.append(wrapped(start, low))
    return out


class FlopCounter:
    """Model arithmetic of the engine's decoding calls (a spy on ``decode.decode_step``) and
    where their time goes (forward hooks on the attention blocks, MLPs and LM head)."""

    def __init__(self, model: torch.nn.Module) -> None:
        c = model.config
        self.d = (
            c.hidden_size // c.num_attention_heads
            if not getattr(c, "head_dim", None)
            else c.head_dim
        )
        self.heads, self.layers = c.num_attention_heads, c.num_hidden_layers
        linear = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        self.body = sum(m.weight.numel() for m in linear if m is not model.lm_head)
        self.head = model.lm_head.weight.numel()
        self.flops = self.rows = self.calls = 0
        self.active = False
        self.seconds = dict.fromkeys(("model", "attention", "shared-prefix", "mlp", "lm_head"), 0.0)
        self._real = decode.decode_step
        self._handles = []
        self._starts: dict[int, float] = {}
        for layer in model.model.layers:
            self._time(layer.self_attn, "attention")
            self._time(layer.mlp, "mlp")
        self._time(model.lm_head, "lm_head")
        self._real_attention = attention.shared_prefix_attention
        self.model = model

    def _time(self, module: torch.nn.Module, key: str) -> None:
        def pre(mod, args):
            self._starts[id(mod)] = clock()

        def post(mod, args, out):
            start = self._starts.pop(id(mod))
            if self.active:  # decoding calls only, not the prefills
                self.seconds[key] += clock() - start

        self._handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def step_flops(self, shared, rows: int, own: int) -> int:
        """A call's useful arithmetic: each row's KEPT prompt entries (the masked layout's
        evicted entries, scored and dropped, are not counted) and its own entries."""
        per_entry = 4 * self.d * self.heads * self.layers
        prompt = sum(
            r.numel() * kept for r, kept in zip(shared.rows, shared.kept_entries(), strict=True)
        )
        return int(rows * 2 * (self.body + self.head) + per_entry * (prompt + rows * own))

    def __enter__(self) -> FlopCounter:
        counter = self

        def spy(model, tokens, position, cache, shared):
            start = clock()
            counter.active = True
            try:
                out = counter._real(model, tokens, position, cache, shared)
            finally:
                counter.active = False
            counter.seconds["model"] += clock() - start
            rows = tokens.shape[0]
            counter.flops += counter.step_flops(shared, rows, cache.get_seq_length())
            counter.rows += rows
            counter.calls += 1
            return out

        def timed_attention(*args, **kwargs):
            start = clock()
            out = counter._real_attention(*args, **kwargs)
            if kwargs.get("kvd_prefix") is not None:
                counter.seconds["shared-prefix"] += clock() - start
            return out

        decode.decode_step = spy
        interface = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS
        self._previous = interface[attention.ATTENTION_NAME]
        interface[attention.ATTENTION_NAME] = timed_attention
        return self

    def __exit__(self, *exc) -> None:
        decode.decode_step = self._real
        transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS[attention.ATTENTION_NAME] = (
            self._previous
        )

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def prefill_flops(counter: FlopCounter, n: int) -> float:
    """A prefill's matrix products: every linear layer per token, the LM head once, causal
    attention (n²/2 query–key pairs, 4·d each per query head and layer)."""
    return (
        n * 2 * counter.body
        + 2 * counter.head
        + 2 * counter.d * counter.heads * counter.layers * n * n
    )


def measure_job(
    model, docs, eos, settings, counter: FlopCounter, actions=ACTIONS, timer=None
) -> dict:
    """The job's documents through ``batched_paths``: the prefills as the engine times them
    (with the actions' window queries); decode seconds are the wall time less the prefills and
    selections. ``timer``: a ``roofline.PartTimer`` timing every part as well."""
    counter.flops = counter.rows = counter.calls = 0
    counter.seconds = dict.fromkeys(counter.seconds, 0.0)
    if timer is not None:
        timer.reset()
    start = clock()
    with counter, timer if timer is not None else contextlib.nullcontext():
        results = dict(batched_paths(model, docs, actions, eos, settings))
    wall = clock() - start
    first = [next(iter(r.values())) for r in results.values()]
    prefill = sum(f.prefill_seconds for f in first)
    selection = sum(r.selection_seconds for res in results.values() for r in res.values())
    seconds = wall - prefill - selection
    paths = sum(len(r.replicates) for res in results.values() for r in res.values())
    tokens = sum(f.n_prompt for f in first)
    flops = sum(prefill_flops(counter, f.n_prompt) for f in first)
    return {
        "seconds": seconds,
        "row_steps_per_s": counter.rows / seconds,
        "gflops": counter.flops / seconds / 1e9,
        "rows_per_call": counter.rows / max(counter.calls, 1),
        "path_seconds": seconds / paths,
        "breakdown": {**counter.seconds, "outside": seconds - counter.seconds["model"]},
        "prefill": {
            "seconds": prefill,
            "tokens_per_s": tokens / max(prefill, 1e-9),
            "gflops": flops / max(prefill, 1e-9) / 1e9,
        },
    }


def measure_baseline(model, ids, K: int, H: int, eos) -> float:
    """Seconds per coupled path of the per-replicate baseline (``benchmarks/rollout.py``)."""
    from rollout import ACTION, baseline_rollout

    prefill = run_prefill(model, ids, ACTION.window)
    _, seconds = baseline_rollout(model, prefill, K, H, eos)
    return seconds / K


def run(
    model_name: str,
    shape: Shape,
    rows: int,
    baseline: bool,
    device: str,
    dtype: str,
    layout: str = "auto",
    kernel: str = "native",
    with_roofline: bool = False,
) -> dict:
    model = load_model(str(MODELS[model_name]), device=device, dtype=dtype)
    tokenizer = load_tokenizer(str(MODELS[model_name]))
    eos = eos_token_ids(model, tokenizer)
    prompts = document_prompts(tokenizer, shape.n, len(shape.counts))
    docs = [
        (f"bench/{i}", ids, c) for i, (ids, c) in enumerate(zip(prompts, shape.counts, strict=True))
    ]
    counter = FlopCounter(model)
    run_prefill(model, prompts[0][:64])  # warm-up: first-call allocations and kernel choice
    gemm = [gemm_rate(model)]
    weight = next(model.parameters())
    timer = roofline.PartTimer(model) if with_roofline else None
    rates = [roofline.machine_rates(weight.dtype, weight.device)] if with_roofline else []
    settings = RolloutSettings(
        shape.H,
        1,
        max_batch_rows=rows,
        prompt_attention=layout,
        native_attention=kernel == "native",
    )
    dec = measure_job(model, docs, eos, settings, counter, shape.actions, timer)
    prefill = dec.pop("prefill")
    gemm.append(gemm_rate(model))
    if with_roofline:
        rates.append(roofline.machine_rates(weight.dtype, weight.device))
    out = {
        "model": f"{model_name} ({str(model.dtype).removeprefix('torch.')})",
        "shape": shape.name,
        # the native kernel serves CPU float32 only; elsewhere the library kernels run
        "layout": f"{layout}, {kernel if model.device.type == 'cpu' else 'library'}",
        "n": shape.n,
        "prefill": prefill,
        "decode": dec,
    }
    if baseline:
        k = max(v for c in shape.counts for name, v in c.items() if name != "full")  # K
        out["baseline_path_seconds"] = measure_baseline(model, prompts[0], k, shape.H, eos)
        gemm.append(gemm_rate(model))
    counter.close()
    if timer is not None:
        timer.close()
        out["roofline"] = {
            "model": out["model"],
            "shape": shape.name,
            "n": shape.n,
            "rates": rates,
            "threads": torch.get_num_threads(),
            "timer": timer,
            "decode_seconds": dec["seconds"],
            "prefill_seconds": prefill["seconds"],
        }
    out["gemm"] = gemm
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def report(rows: list[dict], file: Any = None) -> None:
    """The table and the decode time by part, in Markdown."""

    def say(*parts: Any) -> None:
        print(*parts, file=file, flush=True)

    where = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available() and torch.cuda.is_initialized()
        else f"CPU {torch.backends.cpu.get_cpu_capability()}"
    )
    say(
        f"torch {torch.__version__}, {where}, {torch.get_num_threads()} threads; "
        f"GEMM: {'×'.join(map(str, GEMM))} in the model's dtype "
        "(min–max of the rates measured before and after the job, and after the baseline); "
        "ratios against their mean\n"
    )
    say(
        "| model | shape | prompt attention | rows/call | decode row-steps/s | decode GFLOP/s | "
        "prefill tok/s | prefill GFLOP/s | GEMM GFLOP/s (min–max) | decode/GEMM | "
        "prefill/GEMM | × baseline | peak RSS GiB |"
    )
    say("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        g = np.array(r["gemm"])
        peak = float(g.mean())
        moved = g.max() > 1.2 * g.min()
        flag = " ⚑ GEMM moved" if moved else ""
        d, p = r["decode"], r["prefill"]
        speedup = (
            f"{r['baseline_path_seconds'] / d['path_seconds']:.1f}×"
            if "baseline_path_seconds" in r
            else "—"
        )
        say(
            f"| {r['model']} | {r['shape']} (n={r['n']}) | {r.get('layout', 'auto')} | "
            f"{d['rows_per_call']:.0f} | "
            f"{d['row_steps_per_s']:.0f} | {d['gflops']:.1f} | {p['tokens_per_s']:.0f} | "
            f"{p['gflops']:.1f} | {g.min():.0f}–{g.max():.0f}{flag} | "
            f"{d['gflops'] / peak:.0%} of {peak:.0f}{flag} | "
            f"{p['gflops'] / peak:.0%} of {peak:.0f}{flag} | {speedup} | "
            f"{r.get('peak_rss_gib', float('nan')):.1f} |"
        )
    say("\nDecode time by part (seconds; attention blocks include their projections):\n")
    say(
        "| model | shape | prompt attention | decode s | attention | of which shared-prefix | "
        "MLP | LM head | other in calls | outside calls (coupling, softmax, bookkeeping) |"
    )
    say("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        d, b = r["decode"], r["decode"]["breakdown"]
        other = b["model"] - b["attention"] - b["mlp"] - b["lm_head"]
        say(
            f"| {r['model']} | {r['shape']} | {r.get('layout', 'auto')} | {d['seconds']:.1f} | "
            f"{b['attention']:.1f} | "
            f"{b['shared-prefix']:.1f} | {b['mlp']:.1f} | {b['lm_head']:.1f} | {other:.1f} | "
            f"{b['outside']:.1f} |"
        )
    for r in rows:
        if "roofline" in r:
            roofline.report(r["roofline"], say)


def sweep(
    model_name: str, budgets: Sequence[int], H: int, n_docs: int, device: str, dtype: str
) -> None:
    """Decode rate per row budget on the default shape with ``n_docs`` documents (a third of
    them development documents; enough to fill the largest budget's calls)."""
    model = load_model(str(MODELS[model_name]), device=device, dtype=dtype)
    tokenizer = load_tokenizer(str(MODELS[model_name]))
    eos = eos_token_ids(model, tokenizer)
    counts = job_counts(3, 2, 2, n_docs // 3, n_docs - n_docs // 3)
    prompts = document_prompts(tokenizer, 768 - 32, len(counts))
    docs = [(f"bench/{i}", ids, c) for i, (ids, c) in enumerate(zip(prompts, counts, strict=True))]
    counter = FlopCounter(model)
    docs = [(*doc, run_prefill(model, doc[1], actions=ACTIONS)) for doc in docs]  # once
    print(
        f"| {model_name}: row budget | rows/call | row-steps/s | GFLOP/s | GEMM GFLOP/s | ratio |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for budget in budgets:
        g0 = gemm_rate(model)
        d = measure_job(model, docs, eos, RolloutSettings(H, 1, max_batch_rows=budget), counter)
        g = (g0 + gemm_rate(model)) / 2
        print(
            f"| {budget} | {d['rows_per_call']:.0f} | {d['row_steps_per_s']:.0f} | "
            f"{d['gflops']:.1f} | {g:.0f} | {d['gflops'] / g:.0%} |",
            flush=True,
        )
    counter.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--shapes", nargs="+", default=None, help="default: default cpu-study (see --roofline)"
    )
    parser.add_argument(
        "--roofline",
        action="store_true",
        help="time every part against its bound (benchmarks/roofline.py); without --shapes: "
        "the default's job (H = 32), study 1 at 4K and study 2 at 8K (H = 128, whole strata)",
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--H", type=int, default=32)
    parser.add_argument(
        "--K", type=int, default=4, help="evaluation replicates of the study1/study2 shapes"
    )
    parser.add_argument(
        "--documents",
        type=int,
        nargs=2,
        default=[2, 3],
        metavar=("DEV", "EVAL"),
        help="development and evaluation documents of the study1/study2 shapes",
    )
    parser.add_argument(
        "--rows", type=int, default=None, help="max_batch_rows (the schema's default)"
    )
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--sweep", type=int, nargs="+", help="row budgets to compare instead")
    parser.add_argument("--sweep-docs", type=int, default=12, help="documents of the sweep")
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["auto"],
        choices=["auto", "gathered", "masked"],
        help="RolloutSettings.prompt_attention values to time, one after the other",
    )
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=["native"],
        choices=["native", "library"],
        help="prompt kernels to time (RolloutSettings.native_attention), one after the other",
    )
    parser.add_argument(
        "--model-path", action="append", default=[], help="NAME=FOLDER: a model's folder"
    )
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (a pipeline rollout job: 1)"
    )
    args = parser.parse_args()
    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    for item in args.model_path:
        name, _, folder = item.partition("=")
        if name not in MODELS or not folder:
            parser.error(f"--model-path: expected NAME=FOLDER with NAME in {', '.join(MODELS)}")
        MODELS[name] = Path(folder)
    if args.sweep:
        for name in args.models:
            sweep(name, args.sweep, 8, args.sweep_docs, args.device, args.dtype)
        return
    rows = args.rows or default_rows()
    if args.shapes is None and args.roofline:  # the roofline's three shapes
        docs = tuple(args.documents)
        job_shapes = [
            *shapes(["default"], [], 32),
            *shapes(["study1"], [4096], 128, docs, args.K),
            *shapes(["study2"], [8192], 128, docs, args.K),
        ]
    else:
        names = args.shapes or ["default", "cpu-study"]
        job_shapes = shapes(names, args.lengths, args.H, tuple(args.documents), args.K)
    out = []
    for name in args.models:
        for shape in job_shapes:
            runs = [(layout, kernel) for layout in args.layouts for kernel in args.kernels]
            for i, (layout, kernel) in enumerate(runs):
                baseline = not args.no_baseline and i == 0  # the baseline once per shape
                out.append(
                    run(
                        name,
                        shape,
                        rows,
                        baseline,
                        args.device,
                        args.dtype,
                        layout,
                        kernel,
                        args.roofline,
                    )
                )
                if not baseline and "baseline_path_seconds" in out[-1 - i]:
                    out[-1]["baseline_path_seconds"] = out[-1 - i]["baseline_path_seconds"]
                print(f"max_batch_rows {rows}", file=sys.stderr)
                report(out[-1:], file=sys.stderr)  # each row as soon as it is measured
    print(f"max_batch_rows {rows}")
    report(out)


def default_rows() -> int:
    """The config schema's default of ``rollout.max_batch_rows``."""
    import yaml

    schema = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
    return int(schema["properties"]["rollout"]["properties"]["max_batch_rows"]["default"])


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
