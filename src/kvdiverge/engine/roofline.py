"""Roofline estimates of a rollout job's time: the least time a device with a given peak
matrix rate and memory bandwidth could take for its prefills and decoding steps
(``docs/running.md``, "Memory and time per job").

A step takes max(bytes moved / bandwidth, floating-point operations / peak rate). The bytes of
a decoding step are the weights (read once for all rows), each document's prompt parts (the
full cache once for its X rows and its masked pass, each gathered part once) and the rows' own
generated entries; its operations are 2 per parameter and row, plus the attention's 4·H·d per
row and attended entry. A prefill of n tokens is 2·(parameters)·n plus the causal attention's
2·L·H·d·n² operations, at the peak rate. Every planned row is counted at every step (rows
leave the batch when their streams end, Z rows join only after a split), so the estimate is a
bound from below on a device's time only under that assumption. The device figures are the
vendors' published dense bf16 rates and HBM bandwidths, assumptions, not measurements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvdiverge.engine.batch_plan import MASKED_MIN_FRACTION
from kvdiverge.engine.memory_plan import ModelShape, job_kept, kv_bytes

__all__ = [
    "DEVICES",
    "Device",
    "Work",
    "causal_attention_work",
    "coupling_work",
    "decode_step_seconds",
    "job_seconds",
    "kernel_work",
    "lm_head_work",
    "mlp_work",
    "own_attention_work",
    "plan_seconds",
    "prefill_seconds",
    "projection_work",
    "prompt_attention_work",
]


@dataclass(frozen=True)
class Device:
    """A device's published peak dense bf16 matrix rate (FLOP/s) and memory bandwidth (B/s)."""

    name: str
    flops: float
    bandwidth: float


# published figures (vendor data sheets; SXM parts, dense, no sparsity): assumptions
DEVICES: Mapping[str, Device] = {
    "h200": Device("H200 SXM (assumed 989 TFLOP/s bf16, 4.8 TB/s)", 989e12, 4.8e12),
    "h100": Device("H100 SXM (assumed 989 TFLOP/s bf16, 3.35 TB/s)", 989e12, 3.35e12),
    "a100-80gb": Device("A100 80GB SXM (assumed 312 TFLOP/s bf16, 2.04 TB/s)", 312e12, 2.039e12),
}


def prefill_seconds(shape: ModelShape, n: int, device: Device) -> float:
    """One n-token prefill at the peak rate: 2·P·n + 2·L·H·d·n² operations."""
    flops = 2 * shape.parameters() * n + 2 * shape.layers * shape.heads * shape.head_dim * n * n
    return flops / device.flops


def decode_step_seconds(
    shape: ModelShape,
    lengths: Sequence[int],
    kept: Sequence[Sequence[int]],
    rows: int,
    generated: int,
    device: Device,
) -> float:
    """One decoding step of ``rows`` rows over the documents ``lengths`` (``kept[d]``: each
    action's kept entries), each row holding ``generated`` entries of its own."""
    prompt = 0.0
    attended = 0.0
    for n, keep in zip(lengths, kept, strict=True):
        gathered = [k for k in keep if k < MASKED_MIN_FRACTION * n]
        prompt += kv_bytes(shape, n) + sum(kv_bytes(shape, k) for k in gathered)
        attended += n
    per_row_entries = attended / max(len(lengths), 1) + generated
    weights = shape.parameters() * shape.dtype_bytes
    moved = weights + prompt + kv_bytes(shape, rows * generated)
    flops = 2 * shape.parameters() * rows
    flops += 4 * shape.layers * shape.heads * shape.head_dim * rows * per_row_entries
    return max(moved / device.bandwidth, flops / device.flops)


def job_seconds(
    shape: ModelShape,
    lengths: Sequence[int],
    kept: Sequence[Sequence[int]],
    batches: Sequence[Sequence[int]],
    rows: Sequence[int],
    H: int,
    device: Device,
) -> dict[str, float]:
    """A job's prefill and decode seconds at the roofline: every document's prefill, and for
    each batch (``batches[b]``: its documents, ``rows[b]`` its rows) H − 1 steps at the mean
    number of generated entries, H / 2."""
    prefill = sum(prefill_seconds(shape, n, device) for n in lengths)
    decode = 0.0
    for docs, n_rows in zip(batches, rows, strict=True):
        step = decode_step_seconds(
            shape, [lengths[d] for d in docs], [kept[d] for d in docs], n_rows, H // 2, device
        )
        decode += (H - 1) * step
    return {"prefill": prefill, "decode": decode}


def plan_seconds(
    config: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], device: Device
) -> list[dict[str, float]]:
    """Prefill and decode seconds at the roofline of each job of
    :func:`kvdiverge.engine.memory_plan.plan_config`'s rows (documents at the length bound)."""
    from kvdiverge.eviction import parse_action

    specs = {n: parse_action(a, name=n) for n, a in config.get("actions", {}).items()}
    H = int(config.get("rollout", {}).get("H", 128))
    out = []
    for row in rows:
        plan, study = row["plan"], row["job"].split("/")[0]
        actions = [specs[a] for a in config["studies"][study]["actions"]]
        n_docs = 1 + max(d for batch in plan.documents for d in batch)
        lengths = [row["n"]] * n_docs
        kept = [job_kept(actions, row["n"])] * n_docs
        out.append(job_seconds(row["shape"], lengths, kept, plan.documents, plan.rows, H, device))
    return out


# --- Counting the work of a model call's parts: FLOPs and bytes a machine must at least spend ---
#
# Used by ``benchmarks/throughput.py --roofline`` against the same process's measured GEMM rate
# and memory bandwidth. b is the model's bytes per element (``ModelShape.dtype_bytes``); L
# layers, h hidden size, H query heads, G KV heads, d head size, I MLP width, V vocabulary.
# Matrix products count 2 FLOPs per multiply-add; elementwise work (norms, RoPE, SiLU, exp)
# counts none, so its bound is its memory traffic alone.


@dataclass(frozen=True)
class Work:
    """Floating-point operations and bytes moved of one piece of work."""

    flops: float
    bytes: float

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.bytes + other.bytes)

    def bound(self, rate: float, bandwidth: float) -> float:
        """The least seconds on a machine of ``rate`` FLOP/s and ``bandwidth`` B/s:
        max(flops / rate, bytes / bandwidth)."""
        return max(self.flops / rate, self.bytes / bandwidth)


def _attention_weights(shape: ModelShape) -> int:
    """Per layer the q, k, v, o weights: h·(H + 2G)·d + H·d·h."""
    h, d = shape.hidden, shape.head_dim
    return h * (shape.heads + 2 * shape.kv_heads) * d + shape.heads * d * h


def projection_work(shape: ModelShape, rows: int) -> Work:
    """The attention blocks' q, k, v and o projections of ``rows`` rows (tokens).

    FLOPs 2·rows·L·W with W = h·(H + 2G)·d + H·d·h; bytes b·L·(W + B) for the weights (B =
    (H + 2G)·d biases when the model has them) read once, plus b·rows·L·(4h + (2H + 2G)·d): q, k
    and v each read the row's input (3h) and write (H + 2G)·d, o reads H·d and writes h."""
    w = _attention_weights(shape)
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    bias = qkv if shape.qkv_bias else 0
    b, L, h, d = shape.dtype_bytes, shape.layers, shape.hidden, shape.head_dim
    activations = 4 * h + (2 * shape.heads + 2 * shape.kv_heads) * d
    return Work(2 * rows * L * w, b * L * (w + bias) + b * rows * L * activations)


def mlp_work(shape: ModelShape, rows: int) -> Work:
    """The MLPs (gate, up, down: 3·h·I weights a layer) of ``rows`` rows.

    FLOPs 2·rows·L·3·h·I; bytes b·L·3·h·I for the weights plus b·rows·L·(3h + 3I): gate and up
    each read h and write I, down reads I and writes h (the SiLU and product in between are
    elementwise, not counted)."""
    b, L, h, i = shape.dtype_bytes, shape.layers, shape.hidden, shape.intermediate
    return Work(2 * rows * L * 3 * h * i, b * L * 3 * h * i + b * rows * L * (3 * h + 3 * i))


def lm_head_work(shape: ModelShape, rows: int) -> Work:
    """The LM head (V·h weights) of ``rows`` rows: FLOPs 2·rows·V·h; bytes b·V·h for the weights,
    b·rows·h read and b·rows·V of logits written."""
    b, h, v = shape.dtype_bytes, shape.hidden, shape.vocab
    return Work(2 * rows * v * h, b * v * h + b * rows * h + b * rows * v)


def prompt_attention_work(
    shape: ModelShape, rows: int, attended: float, read: float, masked: float = 0.0
) -> Work:
    """One prompt-attention product of a decoding call: ``rows`` rows, ``attended`` the sum over
    those rows of the prompt entries each attends to (per layer and KV head: its kept entries),
    ``read`` the prompt entries the product reads (per layer and KV head: the full prompt for a
    masked pass, the part's width for a gathered part), ``masked`` the sum over the product's
    masked groups of the prompt length (each reads a float32 bias row per layer and KV head).

    FLOPs 4·d·H·L·attended (2d for the score and 2d for the weighted value, per query head and
    entry); bytes 2·L·G·read·d·b for the keys and values read once, 4·L·G·masked for the masks
    and 2·b·L·H·d·rows for the queries read and the outputs written."""
    b, L, d, H, G = shape.dtype_bytes, shape.layers, shape.head_dim, shape.heads, shape.kv_heads
    moved = kv_bytes(shape, read) + 4 * L * G * masked + 2 * b * L * H * d * rows
    return Work(4 * d * H * L * attended, moved)


def own_attention_work(shape: ModelShape, rows: int, entries: int) -> Work:
    """The decoding rows' attention to their own generated entries (``entries`` each, the step's
    own included): FLOPs 4·d·H·L·rows·entries; bytes 2·L·G·d·b·rows·entries for the row
    caches' keys and values read and 2·b·L·H·d·rows for the queries and outputs."""
    b, L, d, H = shape.dtype_bytes, shape.layers, shape.head_dim, shape.heads
    return Work(
        4 * d * H * L * rows * entries, kv_bytes(shape, rows * entries) + 2 * b * L * H * d * rows
    )


def causal_attention_work(shape: ModelShape, n: int) -> Work:
    """A prefill's causal attention over n tokens: n·(n + 1)/2 query–key pairs per query head and
    layer, FLOPs 4·d·H·L·n·(n + 1)/2; bytes b·L·n·d·(2H + 2G): the queries and keys and values
    read once and the outputs written (a flash kernel's floor)."""
    b, L, d, H, G = shape.dtype_bytes, shape.layers, shape.head_dim, shape.heads, shape.kv_heads
    return Work(2 * d * H * L * n * (n + 1), b * L * n * d * (2 * H + 2 * G))


def kernel_work(rows: int, vocab: int, logit_bytes: int = 4) -> Work:
    """The sampling kernels softmax(logits / T) of ``rows`` rows in float64: the logits read
    (``logit_bytes`` each) and the float64 probabilities written, rows·V·(logit_bytes + 8)
    bytes; no matrix arithmetic."""
    return Work(0.0, rows * vocab * (logit_bytes + 8))


def coupling_work(rows: int, vocab: int) -> Work:
    """The coupling of a step (TV, fixed-history TV, inverse CDFs) at its floor: every batch
    row's float64 probabilities read once, 8·rows·V bytes (one fused pass); no matrix
    arithmetic."""
    return Work(0.0, 8 * rows * vocab)
