"""The library kernels: torch's fused attention kernels that also return the log-sum-exp.

Each is wrapped in the registry's conventions (:mod:`kvdiverge.engine.kernels.reference`):
dense for ``rows_own``, prompt (H_kv, M, d) with an optional bias table and row index for the
prompt layouts. A masked call builds each query row's additive bias (1, H_kv, M, n) in the
kernel's dtype with its row stride padded to a multiple of :data:`BIAS_ALIGN` elements
(:func:`padded_bias`: the memory-efficient CUDA kernel refuses a bias whose rows are not
aligned; torch's public ``scaled_dot_product_attention`` pads the same way), and sets the rows
that keep no entry to output 0 and log-sum-exp −inf (:func:`empty_rows`; the fused kernels give
NaN there), without a host synchronisation. The CPU flash kernel runs the prompt layouts in
blocks of :data:`~kvdiverge.engine.kernels.reference.ROW_BLOCK` query rows (``row_block``):
its own query blocks of 32 rows leave a tail of one to three rows whenever M is just past a
multiple of 32, and torch's CPU matrix products round a product of so few rows differently, so
without the blocks a row's bits depended on where it lay in the call.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "BIAS_ALIGN",
    "cpu_flash",
    "cuda_efficient",
    "cuda_flash",
    "empty_rows",
    "padded_bias",
    "prompt_call",
]

BIAS_ALIGN = 16  # elements: the memory-efficient kernel's alignment of a bias row


def cpu_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: Any = None
) -> Any:
    """CPU flash attention (B, h, s, d): (output, log-sum-exp), ``bias`` additive or None."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=bias, scale=scale
    )[:2]


def cuda_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: Any = None
) -> Any:
    """CUDA flash attention (fp16/bf16; no bias): (output, log-sum-exp)."""
    if bias is not None:
        raise ValueError("the CUDA flash kernel takes no bias")
    return torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, False, False, scale=scale
    )[:2]


def cuda_efficient(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: Any = None
) -> Any:
    """CUDA memory-efficient attention, ``bias`` additive (rows aligned: :func:`padded_bias`)
    or None: (output, log-sum-exp)."""
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, False, scale=scale
    )[:2]
    return out, lse[..., : q.shape[-2]]  # the log-sum-exp may be padded along the queries


def padded_bias(
    table: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype, align: int = BIAS_ALIGN
) -> torch.Tensor:
    """(1, H_kv, M, n) additive bias in ``dtype``, row m = ``table[rows[m]]`` (zeros where −1),
    laid out with a row stride of n rounded up to a multiple of ``align`` elements (a view of
    a (1, H_kv, M, n_pad) buffer; the padding is never read by a kernel: its length is n)."""
    _, h, n = table.shape
    m = rows.numel()
    width = -(-max(n, 1) // align) * align
    out = torch.empty((1, h, m, width), dtype=dtype, device=table.device)[..., :n]
    source = torch.cat([table.new_zeros((1, h, n)), table])
    out[0].copy_(source.index_select(0, rows.long() + 1).transpose(0, 1))
    return out


def empty_rows(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(H_kv, M) bool: the query rows (per KV head) whose bias drops every entry."""
    h = table.shape[1]
    dropped = torch.isneginf(table).all(dim=-1)  # (T, h)
    dropped = torch.cat([dropped.new_zeros((1, h)), dropped])
    return dropped.index_select(0, rows.long() + 1).transpose(0, 1)


def prompt_call(kernel: Any, row_block: int | None = None) -> Any:
    """``kernel`` (a dense 4-D kernel with an optional bias) in the prompt convention: q
    (H_kv, M, d) over k, v (H_kv, n, d) with an optional bias table and row index; float32
    output (H_kv, M, d) and log-sum-exp (H_kv, M), rows that keep nothing at 0 and −inf.

    ``row_block``: the M query rows run as a batch of blocks of exactly that many rows (the
    last padded with zero queries and no bias; k and v expanded, not copied), so that every
    query block the kernel computes has the same shape whatever M is; None: one call of M rows."""

    def run(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        table: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if row_block is None:
            bias = None if table is None else padded_bias(table, rows, q.dtype)
            out, lse = kernel(q[None], k[None], v[None], scale, bias)
            out, lse = out[0].float(), lse[0].float()
        else:
            out, lse = _in_blocks(kernel, row_block, q, k, v, scale, table, rows)
        if table is not None:
            empty = empty_rows(table, rows)
            out = out.masked_fill(empty[..., None], 0.0)
            lse = lse.masked_fill(empty, float("-inf"))
        return out, lse

    run.__name__ = f"prompt_{kernel.__name__}"
    return run


def _in_blocks(
    kernel: Any,
    block: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    table: torch.Tensor | None,
    rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernel`` on q (H_kv, M, d) as (blocks, H_kv, ``block``, d): float32 (H_kv, M, d) output
    and (H_kv, M) log-sum-exp (the padding rows dropped)."""
    h, m, d = q.shape
    blocks = max(1, -(-m // block))
    width = blocks * block
    qb = torch.nn.functional.pad(q, (0, 0, 0, width - m)).view(h, blocks, block, d)
    qb = qb.transpose(0, 1).contiguous()
    kb, vb = (x[None].expand(blocks, -1, -1, -1) for x in (k, v))
    bias = None
    if table is not None:
        tail = torch.full((width - m,), -1, dtype=torch.int32, device=rows.device)
        padded = torch.cat([rows.to(torch.int32), tail])
        bias = padded_bias(table, padded, q.dtype)[0].unflatten(1, (blocks, block)).transpose(0, 1)
    out, lse = kernel(qb, kb, vb, scale, bias)
    out = out.transpose(0, 1).reshape(h, width, -1)[:, :m].float()
    return out, lse.transpose(0, 1).reshape(h, width)[:, :m].float()
