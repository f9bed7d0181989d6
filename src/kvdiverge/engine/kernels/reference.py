"""The float32 reference attention (the oracle every other kernel is validated against).

Two conventions (``docs/engine.md``, "Attention kernels"):

* dense, the ``rows_own`` and ``prompt_gathered`` layouts' library form: (…, s, d) queries over
  (…, n, d) keys and values (:func:`math_attention`);
* prompt, every prompt layout: q (H_kv, M, d) over keys and values (H_kv, n, d), optionally
  with an additive bias table (T, H_kv, n) (−inf drops an entry) and each query row's index
  into it (M,), −1 for no bias (:func:`prompt_reference`).

Both return the normalised output and the log-sum-exp in float32; a row with every entry
dropped (or no entry at all) gets output 0 and log-sum-exp −inf.

A row's bits must not depend on where it lies in a call or on how many rows the call holds (the
full control shares products with the reference rows, and rows leave the batch as they end):
torch's CPU matrix products take another path, which rounds differently, for a product of at
most three rows, so the prompt convention runs its queries in blocks of exactly
:data:`ROW_BLOCK` rows (:func:`prompt_reference`), and every CPU candidate must pass
:func:`stable` besides :func:`agrees`.
"""

from __future__ import annotations

import torch

__all__ = [
    "MAX_SCORES",
    "ROW_BLOCK",
    "STABLE_COUNTS",
    "agrees",
    "full_bias",
    "math_attention",
    "prompt_reference",
    "stable",
    "validation_problems",
]

MAX_SCORES = 1 << 26
"""The most float32 scores :func:`math_attention` holds at once (2²⁶, 256 MiB): longer query
sets are split into chunks of queries under it (read at each call, so a test lowers it to run
the split on small inputs)."""

ROW_BLOCK = 32
"""Query rows per matrix product in the prompt convention (:func:`prompt_reference`, the CPU
flash kernel's wrapper): the last block is padded with zero queries, so every product of a call
has this many rows whatever the call holds."""


def math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of (…, s, d) queries over (…, n, d) keys: (output, log-sum-exp).

    out = softmax(scale·q·kᵀ + bias)·v and lse = log Σ_j exp(scale·q·k_j + bias_j), in float32
    whatever the inputs' dtype (bf16 scores would lose the precision fused kernels keep
    internally). ``bias`` (…, 1, n) or (…, s, n) is added to the scores. A row with every key
    masked, or with no key (n = 0), gives output 0 and log-sum-exp −inf. The queries are split
    so that at most :data:`MAX_SCORES` scores are held at once.
    """
    s, n = q.shape[-2], k.shape[-2]
    if n == 0:
        shape = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
        out = q.new_zeros((*shape, s, v.shape[-1]), dtype=torch.float32)
        return out, out.new_full((*shape, s), float("-inf"))
    chunk = max(1, MAX_SCORES // max(1, n * q[..., :1, :1].numel()))
    if s > chunk:  # bound the transient score matrix: split the queries (and a per-query bias)
        per_query = bias is not None and bias.shape[-2] == s > 1
        parts = [
            math_attention(
                q[..., i : i + chunk, :],
                k,
                v,
                scale,
                bias[..., i : i + chunk, :] if per_query else bias,
            )
            for i in range(0, s, chunk)
        ]
        return torch.cat([p[0] for p in parts], dim=-2), torch.cat([p[1] for p in parts], dim=-1)
    scores = torch.matmul(q.float() * scale, k.float().transpose(-1, -2))
    if bias is not None:
        scores = scores.add_(bias)
    m = scores.amax(dim=-1, keepdim=True)
    if bias is not None:
        m = m.clamp_min(torch.finfo(m.dtype).min)  # every key masked: weights 0, not NaN
    weights = scores.sub_(m).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights, v.float()) / total
    if bias is not None:
        out = out.nan_to_num_(0.0)
    return out, (m + total.log()).squeeze(-1)


def full_bias(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(H_kv, M, n) float32: each query row's bias, row m = ``table[rows[m]]`` (zeros where
    ``rows[m]`` is −1)."""
    h, n = table.shape[1:]
    padded = torch.cat([table.new_zeros((1, h, n)), table]).float()
    return padded.index_select(0, rows.long() + 1).transpose(0, 1)


def prompt_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    table: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt convention's reference: q (H_kv, M, d) over k, v (H_kv, n, d), each query
    row m with the bias ``table[rows[m]]`` (none where −1, or without a table); float32
    (H_kv, M, d) output and (H_kv, M) log-sum-exp.

    The M rows run in blocks of :data:`ROW_BLOCK` (the last padded with zero queries and no
    bias), each block one product of exactly that many rows, as many blocks at once as keep
    the scores under :data:`MAX_SCORES`: a row's bits do not depend on M or on its place."""
    h, m, d = q.shape
    n = k.shape[1]
    blocks = -(-m // ROW_BLOCK)
    if blocks == 0:
        return math_attention(q, k, v, scale)
    pad = blocks * ROW_BLOCK - m
    qb = torch.nn.functional.pad(q, (0, 0, 0, pad)).view(h, blocks, ROW_BLOCK, d)
    bias = None
    if table is not None:
        bias = torch.nn.functional.pad(full_bias(table, rows), (0, 0, 0, pad))
        bias = bias.view(h, blocks, ROW_BLOCK, n)
    step = max(1, MAX_SCORES // max(1, h * ROW_BLOCK * n))
    parts = [
        math_attention(
            qb[:, i : i + step],
            k[:, None],
            v[:, None],
            scale,
            None if bias is None else bias[:, i : i + step],
        )
        for i in range(0, blocks, step)
    ]
    out = torch.cat([p[0] for p in parts], dim=1).reshape(h, blocks * ROW_BLOCK, -1)
    lse = torch.cat([p[1] for p in parts], dim=1).reshape(h, blocks * ROW_BLOCK)
    return out[:, :m], lse[:, :m]


def _random_group_masks(m: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A masked pass's bias table (2 groups × 2 KV heads × n; about half the entries dropped,
    and every entry of group 1's first KV head) and each of m rows' group (0, 1, or -1: none)."""
    drop = torch.rand((2, 2, n), generator=gen) < 0.5
    drop[1, 0] = True
    table = torch.zeros(drop.shape).masked_fill_(drop, float("-inf"))
    rows = torch.arange(m, dtype=torch.int32) % 3 - 1
    return table, rows


def validation_problems(
    layout: str, dtype: torch.dtype, device: torch.device | str, d: int
) -> list[tuple[torch.Tensor, ...]]:
    """Small random problems on which a candidate must agree with the reference, in the
    layout's convention, the inputs in ``dtype`` on ``device``: dense (q, k, v) of 2 × 2 heads,
    5 queries, 37 keys for ``rows_own``; otherwise (q, k, v, table, rows) over prompt lengths 37,
    130 and 200 (not multiples of a kernel's block or alignment) and 5 to 13 query rows, with
    for the masked layouts a table of two masks dropping about half the entries, the second
    dropping every entry of KV head 0 (rows with no entry left), rows cycling −1, 0, 1."""
    gen = torch.Generator().manual_seed(0)
    if layout == "rows_own":
        q, k, v = (torch.randn((2, 2, s, d), generator=gen) for s in (5, 37, 37))
        return [tuple(x.to(device, dtype) for x in (q, k, v))]
    problems = []
    for m, n in ((7, 37), (13, 130), (5, 200)):
        q, k, v = (torch.randn((2, s, d), generator=gen) for s in (m, n, n))
        table = rows = None
        if layout == "prompt_ragged":  # one mask shared by every row: padding at the end
            keep = torch.arange(n)[None] < torch.tensor([[n - 3], [n // 2]])
            table = torch.zeros((1, 2, n)).masked_fill_(~keep[None], float("-inf"))
            rows = torch.zeros(m, dtype=torch.int32)
        elif layout == "prompt_masked":
            table, rows = _random_group_masks(m, n, gen)
        moved = [x.to(device, dtype) for x in (q, k, v)]
        problems.append(
            (*moved, None if table is None else table.to(device), None if rows is None else rows)
        )
    return problems


def agrees(run, layout: str, dtype: torch.dtype, device: torch.device | str, d: int) -> bool:
    """Whether kernel ``run`` runs and gives the reference's output and log-sum-exp (to 1e-5 in
    float32 and float64, 2e-2 in half precision; −inf where the reference has it, 0 output
    there) on every :func:`validation_problems` problem."""
    tol = 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2
    for problem in validation_problems(layout, dtype, device, d):
        try:
            if layout == "rows_own":
                q, k, v = problem
                want = math_attention(q, k, v, d**-0.5)
                got = run(q, k, v, d**-0.5)
            else:
                q, k, v, table, rows = problem
                want = prompt_reference(q, k, v, d**-0.5, table, rows)
                got = run(q, k, v, d**-0.5, table, rows)
        except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError):
            return False  # missing from this torch build, or unsupported for the key
        for g, w in zip(got, want, strict=True):
            if tuple(g.shape) != tuple(w.shape):
                return False
            g = g.float()
            if not torch.equal(torch.isneginf(g), torch.isneginf(w)):
                return False
            finite = torch.isfinite(w)
            if not torch.isfinite(g[finite]).all():
                return False
            if not torch.allclose(g[finite], w[finite], atol=tol, rtol=tol):
                return False
        if layout != "rows_own" and not bool((got[0][torch.isneginf(want[1])] == 0).all()):
            return False
    return True


STABLE_COUNTS = (1, 2, 3, 4, 5, 31, 33, 34, 35, 67)
"""Query rows of :func:`stable`'s calls in the prompt convention: a few (the matrix products'
own path for at most three rows) and just past one and two blocks of 32 (a blocked kernel's
tail of one to three rows)."""


def stable(run, layout: str, dtype: torch.dtype, device: torch.device | str, d: int) -> bool:
    """Whether kernel ``run`` gives every row the same bits wherever it lies in a call and
    however many rows the call holds: ``rows_own`` on batches of 1 to 9 rows cut from one of 10
    (2 KV heads, 3 queries, 21 own entries); a prompt layout on 1 to 67 query rows
    (:data:`STABLE_COUNTS`, from the first and from the second row) cut from a call of 100 over
    45 prompt entries, with the layout's masks as in :func:`validation_problems`. Output and
    log-sum-exp must equal the whole call's rows exactly (torch.equal). On the CPU the check
    runs on one torch thread (the count restored after it), where the full control is claimed
    bit-exact (``docs/method.md``): with several threads the products split rows differently."""
    if torch.device(device).type != "cpu":
        return _stable(run, layout, dtype, device, d)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _stable(run, layout, dtype, device, d)
    finally:
        torch.set_num_threads(threads)


def _stable(run, layout: str, dtype: torch.dtype, device: torch.device | str, d: int) -> bool:
    gen = torch.Generator().manual_seed(4)
    scale = d**-0.5

    def same(got, want, cut) -> bool:
        return all(torch.equal(g, w[cut]) for g, w in zip(got, want, strict=True))

    try:
        if layout == "rows_own":
            q, k, v = (
                torch.randn((10, 2, s, d), generator=gen).to(device, dtype) for s in (3, 21, 21)
            )
            want = run(q, k, v, scale)
            for start, count in ((0, 1), (9, 1), (2, 3), (1, 5), (1, 9)):
                cut = slice(start, start + count)
                if not same(run(q[cut], k[cut], v[cut], scale), want, cut):
                    return False
            return True
        m, n = 100, 45
        q, k, v = (torch.randn((2, s, d), generator=gen).to(device, dtype) for s in (m, n, n))
        table = rows = None
        if layout == "prompt_ragged":
            table = torch.zeros((1, 2, n))
            table[:, 1, n // 2 :] = float("-inf")
            rows = torch.zeros(m, dtype=torch.int32)
        elif layout == "prompt_masked":
            table, rows = _random_group_masks(m, n, gen)
        if table is not None:
            table = table.to(device)
        want = run(q, k, v, scale, table, rows)
        for count in STABLE_COUNTS:
            for start in (0, 1):
                cut = slice(start, start + count)
                index = None if rows is None else rows[cut]
                got = run(q[:, cut], k, v, scale, table, index)
                if not same(got, want, (slice(None), cut)):
                    return False
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError):
        return False
    return True
