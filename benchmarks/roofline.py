"""The roofline of ``benchmarks/throughput.py --roofline``: every part of a rollout job's decoding
steps and prefills against its own bound, measured in the job's process.

The machine's rates, measured in the same process before and after each job, with one thread
and with two: the GEMM rate (``throughput.GEMM``, 2048×576×1536, in the model's dtype, best of
three) and the memory read bandwidth (a 512 MiB float32 tensor summed, well beyond the caches,
best of five; a copy of it is printed beside, bytes read and written). The work of each part is
counted by the pure functions of :mod:`kvdiverge.engine.roofline` (their docstrings give the
formulas): per decoding call the prompt-attention products (keys and values read, masks), the
rows' own entries (row caches), the projections, MLPs and LM head (weights read once per call
for all rows), and per step the float64 kernels and the coupling (the logits and float64
buffers); per prefill the same projections, MLPs and LM head and the causal attention.

Each part's seconds come from explicit timers around the engine's calls: forward hooks on
every attention block, its q/k/v/o projections, MLP and the LM head; spies on the prompt kernels
(``kvdiverge.engine.kernels.attend_prompt``), the shared-prefix attention function, the sampling
kernels (``tempered_kernel`` and ``merge_eos`` as ``kvdiverge.engine.rows`` calls them) and each
unit's coupling (``_UnitRun.couple``). A part's bound is Σ over its calls of max(FLOPs / GEMM
rate, bytes / bandwidth) at the job's thread count; the ratio bound / seconds says how close the
part runs to what the machine allows (1 = at the roofline). Parts with no counted work (RoPE
and cache writes, norms and embeddings, Python bookkeeping) show their seconds only; the total's
bound is the sum of the parts' (they run one after another).
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from torch.utils.weak import WeakIdKeyDictionary

import kvdiverge.engine.attention as attention
import kvdiverge.engine.document as document
import kvdiverge.engine.kernels as kernels
import kvdiverge.engine.rows as rows_module
from kvdiverge.engine.memory_plan import ModelShape
from kvdiverge.engine.roofline import (
    Work,
    causal_attention_work,
    coupling_work,
    kernel_work,
    lm_head_work,
    mlp_work,
    own_attention_work,
    projection_work,
    prompt_attention_work,
)

GEMM = (2048, 576, 1536)
BANDWIDTH_MIB = 512
THREADS = (1, 2)

DECODE_PARTS = (
    ("prompt", "prompt attention (kernels)"),
    ("own", "own entries (kernels)"),
    ("merge", "merge, query gathers, output scatters"),
    ("projections", "q/k/v/o projections"),
    ("attention_rest", "RoPE, cache writes, reshapes"),
    ("mlp", "MLPs"),
    ("lm_head", "LM head"),
    ("call_rest", "norms, embeddings, rest of calls"),
    ("softmax", "float64 softmax + EOS merge"),
    ("coupling", "coupling (TV, inverse CDFs)"),
    ("bookkeeping", "bookkeeping outside calls"),
)
PREFILL_PARTS = (
    ("projections", "q/k/v/o projections"),
    ("attention", "causal attention, RoPE"),
    ("mlp", "MLPs"),
    ("lm_head", "LM head"),
    ("rest", "norms, embeddings, observers, rest"),
)


def _clock() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def gemm_rate(dtype: torch.dtype, device: torch.device, threads: int) -> float:
    """FLOP/s of the 2048×576×1536 GEMM with ``threads`` torch threads (best of three timed runs
    of about a third of a second each)."""
    m, k, n = GEMM
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(s, generator=gen).to(device, dtype) for s in ((m, k), (k, n)))
    with _threads(threads):
        torch.mm(a, b)
        start, reps = _clock(), 0
        while _clock() - start < 0.33 or reps < 2:
            torch.mm(a, b)
            reps += 1
        best = float("inf")
        for _ in range(3):
            start = _clock()
            for _ in range(reps):
                torch.mm(a, b)
            best = min(best, (_clock() - start) / reps)
    return 2 * m * k * n / best


def bandwidth(device: torch.device, threads: int, repeats: int = 5) -> tuple[float, float]:
    """(read, copy) B/s with ``threads`` torch threads: a 512 MiB float32 tensor summed (bytes
    read over the best time of ``repeats``), and copied into another (bytes read and written)."""
    x = torch.ones(BANDWIDTH_MIB * 2**20 // 4, device=device)
    y = torch.empty_like(x)
    size = x.numel() * 4
    best_read = best_copy = float("inf")
    with _threads(threads):
        for _ in range(repeats):
            start = _clock()
            x.sum()
            best_read = min(best_read, _clock() - start)
            start = _clock()
            y.copy_(x)
            best_copy = min(best_copy, _clock() - start)
    return size / best_read, 2 * size / best_copy


def machine_rates(dtype: torch.dtype, device: torch.device) -> dict[int, dict[str, float]]:
    """Per thread count of :data:`THREADS`: the GEMM rate and the read and copy bandwidths."""
    out = {}
    for n in THREADS:
        read, copy = bandwidth(device, n)
        out[n] = {"gemm": gemm_rate(dtype, device, n), "read": read, "copy": copy}
    return out


def model_shape(model: torch.nn.Module) -> ModelShape:
    """The model's :class:`ModelShape` in the dtype it runs in."""
    name = str(next(model.parameters()).dtype).removeprefix("torch.")
    return ModelShape.from_config(model.config.to_dict(), dtype=name)


class PartTimer:
    """Seconds and counted work of every part of a job's decoding calls and prefills.

    Enter it inside :class:`throughput.FlopCounter` (it wraps the spies that one installs).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.shape = model_shape(model)
        self.layer = dataclasses.replace(self.shape, layers=1)  # per-layer kernel calls
        self.groups = self.shape.heads // self.shape.kv_heads
        self.phase: str | None = None
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.works: dict[str, dict[str, list[Work]]] = defaultdict(lambda: defaultdict(list))
        self._kept = WeakIdKeyDictionary()  # a bias table → its rows' mean kept entries
        self._starts: dict[int, float] = {}
        self._handles = []
        for layer in model.model.layers:
            self._time(layer.self_attn, "attention_block")
            for child in layer.self_attn.children():
                if isinstance(child, torch.nn.Linear):
                    self._time(child, "projections")
            self._time(layer.mlp, "mlp")
        self._time(model.lm_head, "lm_head")

    def _time(self, module: torch.nn.Module, key: str) -> None:
        def pre(mod, args):
            self._starts[id(mod)] = _clock()

        def post(mod, args, out):
            start = self._starts.pop(id(mod))
            if self.phase is not None:
                self.seconds[self.phase][key] += _clock() - start

        self._handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def reset(self) -> None:
        self.seconds.clear()
        self.works.clear()

    def _mean_kept(self, table: torch.Tensor) -> torch.Tensor:
        """Per bias-table row: its kept entries, averaged over the KV heads."""
        kept = self._kept.get(table)
        if kept is None:
            kept = (table == 0).sum(-1).double().mean(-1)
            self._kept[table] = kept
        return kept

    def _prompt_work(self, layout: str, q, k, table, row_index) -> Work:
        rows = q.shape[1] // self.groups
        n = k.shape[1]
        if layout == "prompt_masked":
            kept = self._mean_kept(table)
            per_query = torch.where(row_index >= 0, kept[row_index.clamp(min=0).long()], n)
            attended = float(per_query.sum()) / self.groups
            masked = float(torch.unique(row_index[row_index >= 0]).numel()) * n
        else:  # gathered or ragged: every row attends to the part's width
            attended, masked = float(rows * n), float(n if table is not None else 0)
        return prompt_attention_work(self.layer, rows, attended, float(n), masked)

    def __enter__(self) -> PartTimer:
        timer = self
        real_step = rows_module.decode_step
        real_prompt = kernels.attend_prompt
        real_own = kernels.attend_own
        real_kernel, real_merge = rows_module.tempered_kernel, rows_module.merge_eos
        real_couple = rows_module._UnitRun.couple
        real_prefill = document.run_prefill
        interface = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS
        real_attention = interface[attention.ATTENTION_NAME]
        shape = self.shape

        def step(model, tokens, position, cache, shared):
            timer.phase = "decode"
            start = _clock()
            try:
                out = real_step(model, tokens, position, cache, shared)
            finally:
                timer.phase = None
            timer.seconds["decode"]["model"] += _clock() - start
            n_rows = tokens.shape[0]
            works = timer.works["decode"]
            # the rows' own entries, the step's included (appended during the call)
            works["own"].append(own_attention_work(shape, n_rows, cache.get_seq_length()))
            works["projections"].append(projection_work(shape, n_rows))
            works["mlp"].append(mlp_work(shape, n_rows))
            works["lm_head"].append(lm_head_work(shape, n_rows))
            return out

        def prompt(layout, q, k, v, scale, table=None, row_index=None, **kwargs):
            start = _clock()
            out = real_prompt(layout, q, k, v, scale, table, row_index, **kwargs)
            timer.seconds["decode"]["prompt"] += _clock() - start
            timer.works["decode"]["prompt"].append(
                timer._prompt_work(layout, q, k, table, row_index)
            )
            return out

        def own(*args, **kwargs):
            start = _clock()
            out = real_own(*args, **kwargs)
            if timer.phase == "decode":
                timer.seconds["decode"]["own"] += _clock() - start
            return out

        def attention_function(*args, **kwargs):
            start = _clock()
            out = real_attention(*args, **kwargs)
            if kwargs.get("kvd_prefix") is not None and timer.phase == "decode":
                timer.seconds["decode"]["attention_function"] += _clock() - start
            return out

        def kernel(logits, *args, **kwargs):
            start = _clock()
            out = real_kernel(logits, *args, **kwargs)
            timer.seconds["decode"]["softmax"] += _clock() - start
            n_rows, vocab = logits.shape
            timer.works["decode"]["softmax"].append(
                kernel_work(n_rows, vocab, logits.element_size())
            )
            timer.works["decode"]["coupling"].append(coupling_work(n_rows, vocab))
            return out

        def merge(*args, **kwargs):
            start = _clock()
            out = real_merge(*args, **kwargs)
            timer.seconds["decode"]["softmax"] += _clock() - start
            return out

        def couple(run, *args, **kwargs):
            start = _clock()
            out = real_couple(run, *args, **kwargs)
            timer.seconds["decode"]["coupling"] += _clock() - start
            return out

        def prefill(model, input_ids, *args, **kwargs):
            timer.phase = "prefill"
            try:
                out = real_prefill(model, input_ids, *args, **kwargs)
            finally:
                timer.phase = None
            n = len(input_ids)
            works = timer.works["prefill"]
            works["projections"].append(projection_work(shape, n))
            works["mlp"].append(mlp_work(shape, n))
            works["lm_head"].append(lm_head_work(shape, 1))  # the last position's logits
            works["attention"].append(causal_attention_work(shape, n))
            return out

        self._real = (
            real_step,
            real_prompt,
            real_kernel,
            real_merge,
            real_couple,
            real_prefill,
            real_attention,
            real_own,
        )
        rows_module.decode_step = step
        kernels.attend_prompt = prompt
        kernels.attend_own = own
        rows_module.tempered_kernel, rows_module.merge_eos = kernel, merge
        rows_module._UnitRun.couple = couple
        document.run_prefill = prefill
        interface[attention.ATTENTION_NAME] = attention_function
        return self

    def __exit__(self, *exc: Any) -> None:
        step, prompt, kernel, merge, couple, prefill, attn, own = self._real
        rows_module.decode_step = step
        kernels.attend_prompt = prompt
        kernels.attend_own = own
        rows_module.tempered_kernel, rows_module.merge_eos = kernel, merge
        rows_module._UnitRun.couple = couple
        document.run_prefill = prefill
        transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS[attention.ATTENTION_NAME] = attn

    def parts(self, phase: str, total: float) -> dict[str, float]:
        """Seconds per part of ``phase`` ("decode" or "prefill", whose total is ``total``)."""
        s = self.seconds[phase]
        if phase == "decode":
            block = s["attention_block"]
            calls = s["model"]
            return {
                "prompt": s["prompt"],
                "own": s["own"],
                "merge": s["attention_function"] - s["prompt"] - s["own"],
                "projections": s["projections"],
                "attention_rest": block - s["projections"] - s["attention_function"],
                "mlp": s["mlp"],
                "lm_head": s["lm_head"],
                "call_rest": calls - block - s["mlp"] - s["lm_head"],
                "softmax": s["softmax"],
                "coupling": s["coupling"],
                "bookkeeping": total - calls - s["softmax"] - s["coupling"],
            }
        block = s["attention_block"]
        return {
            "projections": s["projections"],
            "attention": block - s["projections"],
            "mlp": s["mlp"],
            "lm_head": s["lm_head"],
            "rest": total - block - s["mlp"] - s["lm_head"],
        }

    def bounds(self, phase: str, rate: float, read: float) -> dict[str, tuple[Work, float]]:
        """Per counted part of ``phase``: its summed work and Σ over its calls of the bound."""
        out = {}
        for part, works in self.works[phase].items():
            total = sum(works, Work(0.0, 0.0))
            out[part] = (total, sum(w.bound(rate, read) for w in works))
        return out


def _num(x: float) -> str:
    """Three significant figures below 100, else a whole number."""
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def table(
    timer: PartTimer, phase: str, total: float, rates: dict[str, float], say: Callable
) -> dict[str, float]:
    """A Markdown table of ``phase``'s parts: seconds, GFLOP, GB, bound, bound / seconds; returns
    the total's seconds and bound."""
    labels = dict(DECODE_PARTS if phase == "decode" else PREFILL_PARTS)
    seconds = timer.parts(phase, total)
    bounds = timer.bounds(phase, rates["gemm"], rates["read"])
    say(f"| {phase} part | seconds | GFLOP | GB moved | bound s | bound / seconds |")
    say("|---|---:|---:|---:|---:|---:|")
    all_bound = 0.0
    for part, label in labels.items():
        sec = seconds[part]
        if part in bounds:
            work, bound = bounds[part]
            all_bound += bound
            ratio = f"{bound / sec:.0%}" if sec > 0 else "—"
            say(
                f"| {label} | {_num(sec)} | {_num(work.flops / 1e9)} | {_num(work.bytes / 1e9)} "
                f"| {_num(bound)} | {ratio} |"
            )
        else:
            say(f"| {label} | {_num(sec)} | — | — | — | — |")
    ratio = f"{all_bound / total:.0%}" if total > 0 else "—"
    say(f"| **all** | {_num(total)} | | | {_num(all_bound)} | {ratio} |")
    return {"seconds": total, "bound": all_bound}


def report(result: dict, say: Callable) -> None:
    """The job's machine rates and its decode and prefill roofline tables."""
    rates, threads = result["rates"], result["threads"]
    say(f"\n#### Roofline: {result['model']}, {result['shape']} (n = {result['n']})\n")
    say("| threads | GEMM GFLOP/s (before, after) | read GB/s (before, after) | copy GB/s |")
    say("|---:|---:|---:|---:|")
    for n in THREADS:
        b, a = rates[0][n], rates[1][n]
        say(
            f"| {n} | {b['gemm'] / 1e9:.0f}, {a['gemm'] / 1e9:.0f} | "
            f"{b['read'] / 1e9:.1f}, {a['read'] / 1e9:.1f} | "
            f"{b['copy'] / 1e9:.1f}, {a['copy'] / 1e9:.1f} |"
        )
    used = {k: (rates[0][threads][k] + rates[1][threads][k]) / 2 for k in ("gemm", "read")}

    def moved(n: int) -> bool:  # a rate at n threads differs by more than 20% before and after
        return any(max(r[n][k] for r in rates) > 1.2 * min(r[n][k] for r in rates) for k in used)

    # the bounds use the job's own thread count: only its rates decide whether this is a result
    others = [n for n in THREADS if n != threads and moved(n)]
    say(
        f"\nBounds at {threads} thread(s): GEMM {used['gemm'] / 1e9:.0f} GFLOP/s, read "
        f"{used['read'] / 1e9:.1f} GB/s (means of before and after)"
        + (" ⚑ a rate moved by more than 20%: not a result" if moved(threads) else "")
        + (
            f" (the {', '.join(map(str, others))}-thread rates moved by more than 20%: "
            "shown for reference, not used)"
            if others
            else ""
        )
        + "\n"
    )
    timer = result["timer"]
    result["decode_roofline"] = table(timer, "decode", result["decode_seconds"], used, say)
    say("")
    result["prefill_roofline"] = table(timer, "prefill", result["prefill_seconds"], used, say)
