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

from kvdiverge.engine.memory_plan import ModelShape, job_kept, kv_bytes
from kvdiverge.engine.settings import MASKED_MIN_FRACTION

__all__ = [
    "DEVICES",
    "Device",
    "decode_step_seconds",
    "job_seconds",
    "plan_seconds",
    "prefill_seconds",
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
