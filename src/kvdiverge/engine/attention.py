"""Shared-prefix attention: every decoding row attends to a prompt cache held once per row group.

The engine's model calls (``docs/architecture.md``, "Shared-prefix attention") decode many rows
at once — the reference rows X on the full prompt cache, each action's rows Y and Z on its
evicted cache. A prompt part is one tensor for all the rows of its group, never copied per row:
:func:`shared_prefix_attention` (registered with transformers' ``AttentionInterface`` as
:data:`ATTENTION_NAME`) scores each group's queries against its prompt part in one batched
product, scores each row's own generated entries (:class:`RowCache`) separately, and merges the
two exactly by their log-sum-exp. Fused kernels that return the log-sum-exp are used where one is
validated for the device and dtype (:func:`_fused_kernel`), else the plain float32 path.

Two layouts serve a document's prompt groups (``docs/architecture.md``, "Shared-prefix
attention"): the gathered one scores each group's queries against its own gathered kept entries
(a few rows against thousands of entries: bound by memory), and the masked one
(:class:`PromptPass`) scores the queries of several groups of one document in ONE product
against the document's full prompt cache, each group's evicted entries masked out per layer and
KV head (ragged kept sets included), so the prompt is read for those rows together (by the CPU
flash kernel once per block of 32 or 64 queries) instead of once per group; the masked entries
cost arithmetic, not memory. Both give each row the same softmax over its kept entries, to float
rounding; which wins depends on the kept fraction (``RolloutSettings.prompt_attention``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvdiverge.engine import native

__all__ = [
    "ATTENTION_NAME",
    "PromptPass",
    "RowCache",
    "SharedPrefix",
    "attention_implementation",
    "shared_prefix_attention",
]

log = logging.getLogger(__name__)

ATTENTION_NAME = "kvdiverge_shared_prefix"


@dataclass
class PromptPass:
    """Row groups of one document that attend to its full prompt cache in ONE masked product.

    ``groups``: indices into :attr:`SharedPrefix.rows` (their entry of ``prompts`` is not read);
    ``prompt[l] = (keys, values)``: the document's full cache of layer l, (H_kv, n, d);
    ``masks[i]``: group ``groups[i]``'s kept entries, per layer a (H_kv, n) bool tensor (true:
    kept), or ``None`` when it keeps every entry (the X rows, the full-retention control).
    """

    groups: list[int]
    prompt: list[tuple[torch.Tensor, torch.Tensor]]
    masks: list[list[torch.Tensor] | None]

    def __post_init__(self) -> None:
        # per group and layer: the additive mask (H_kv, n), 0 where kept and −inf elsewhere;
        # whether some KV head keeps nothing (the fused kernels would give NaN there); and the
        # entries each group keeps per layer and KV head, on average (arithmetic counts)
        self.biases: list[list[torch.Tensor] | None] = []
        self.empty_head = False
        n = self.prompt[0][0].shape[-2]
        self.kept = [
            float(n)
            if m is None
            else float(sum(int(x.sum()) for x in m)) / sum(x.numel() // n for x in m)
            for m in self.masks
        ]
        for mask in self.masks:
            if mask is None:
                self.biases.append(None)
                continue
            self.empty_head |= any(bool((~m).all(dim=-1).any()) for m in mask)
            inf = float("-inf")
            self.biases.append(
                [torch.zeros(m.shape, device=m.device).masked_fill_(~m, inf) for m in mask]
            )
        # the native kernel's per-layer bias table: the masked groups' biases stacked, and each
        # group's row in it (−1: no mask)
        self.bias_rows = []
        for bias in self.biases:
            self.bias_rows.append(-1 if bias is None else sum(r >= 0 for r in self.bias_rows))
        self._tables: dict[int, torch.Tensor] = {}

    def bias_table(self, layer: int) -> torch.Tensor | None:
        """(groups with a mask, H_kv, n): their additive masks of ``layer`` (built once)."""
        if not any(b is not None for b in self.biases):
            return None
        if layer not in self._tables:
            self._tables[layer] = torch.stack([b[layer] for b in self.biases if b is not None])
        return self._tables[layer]


@dataclass
class SharedPrefix:
    """The shared prompt parts of a model call (passed as the ``kvd_prefix`` kwarg).

    Row group g — the batch rows ``rows[g]`` (a LongTensor) — attends to the prompt part
    ``prompts[g][l] = (keys, values)`` of layer l, each of shape (H_kv, n_g, d): the full cache
    for the X rows, an action's evicted cache for its Y and Z rows. A prompt part is one tensor
    for all its rows, never copied per row (docs/architecture.md, "Shared-prefix attention").
    A ragged part (KV heads keeping different counts, e.g. kvpress's AdaKV) is padded to its
    longest head and carries a third element, ``mask`` (H_kv, n_g), false at the padding: those
    entries get no attention weight.
    """

    rows: list[torch.Tensor]
    prompts: list[list[tuple[torch.Tensor, torch.Tensor]]]
    fused: bool = True  # use a validated fused attention kernel where one exists
    passes: list[PromptPass] = field(default_factory=list)  # masked passes over full prompts
    native: bool = True  # with ``fused``: the native prompt kernel where built and validated

    def kept_entries(self) -> list[float]:
        """Per row group: the prompt entries its rows attend to per layer and KV head (their
        mean for ragged or masked kept sets; a padded ragged part counts its width)."""
        out = [float(prompt[0][0].shape[1]) for prompt in self.prompts]
        for part in self.passes:
            for g, kept in zip(part.groups, part.kept, strict=True):
                out[g] = kept
        return out


class RowCache:
    """Decode cache holding only each row's own generated entries.

    Preallocated (B, H_kv, capacity, d) per layer for up to B rows. A model call runs the
    first ``rows`` of them (all by default); ``update`` appends the step's entries of those
    rows and returns their filled part (views, no copy). Every running row advances one entry
    per step; :meth:`copy_rows` starts a new row from another row's history.
    """

    is_compileable = False

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (batch, n_kv_heads, capacity, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lengths = [0] * n_layers
        self.rows = batch

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (rows, H_kv, q, d) entries for layer ``layer_idx``; return all of that layer's."""
        start = self.lengths[layer_idx]
        stop = start + key_states.shape[-2]
        rows = self.rows
        self.keys[layer_idx][:rows, :, start:stop] = key_states
        self.values[layer_idx][:rows, :, start:stop] = value_states
        self.lengths[layer_idx] = stop
        return self.keys[layer_idx][:rows, :, :stop], self.values[layer_idx][:rows, :, :stop]

    def copy_rows(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Give rows ``target`` the generated entries held so far by rows ``source``."""
        for layer, length in enumerate(self.lengths):
            for part in (self.keys[layer], self.values[layer]):
                part[target, :, :length] = part[source, :, :length]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only rows ``rows`` (in that order), moved to the front."""
        for layer, length in enumerate(self.lengths):
            for part in (self.keys[layer], self.values[layer]):
                part[: rows.numel(), :, :length] = part[rows, :, :length]
        self.rows = rows.numel()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Generated entries held for ``layer_idx`` (the prompt part is not in this cache)."""
        return self.lengths[layer_idx]


_MAX_SCORES = 1 << 26  # float32 scores held at once by the plain path (256 MiB)


def _math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of (…, s, d) queries over (…, n, d) keys: (output, log-sum-exp).

    Scores, softmax and the weighted sum run in float32 whatever the model dtype (bf16 scores
    would lose the precision SDPA keeps internally). ``bias`` (…, 1, n) or (…, s, n): added to
    the scores (−inf masks a key out; a row with every key masked gives output 0 and log-sum-exp
    −inf).
    """
    s, n = q.shape[-2], k.shape[-2]
    chunk = max(1, _MAX_SCORES // max(1, n * q[..., :1, :1].numel()))
    if s > chunk:  # bound the transient score matrix: split the queries (and a per-query bias)
        per_query = bias is not None and bias.shape[-2] == s > 1
        parts = [
            _math_attention(
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


def _attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, fused: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, h, s, d) × (B, h, n, d) → normalised output (float32) and log-sum-exp (B, h, s).

    A fused attention kernel that also returns the log-sum-exp where one is available and
    validated for the device and dtype (:func:`_fused_kernel`: CPU flash attention; on CUDA
    flash attention for fp16/bf16, else memory-efficient attention), otherwise the plain
    matmul–softmax path (always with ``fused=False``). The fused kernels never hold the score
    matrix.
    """
    kernel = _fused_kernel(q) if fused else None
    if kernel is not None and q.numel() and k.numel():  # (fused kernels may fault on empty)
        try:
            out, lse = kernel(q, k, v, scale)
            return out.float(), lse.float()
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
            key = (q.device.type, q.dtype, q.shape[-1])
            log.warning("fused attention %s failed (%s); using the plain path", key, exc)
            _FUSED[key] = None
    return _math_attention(q, k, v, scale)


def _cpu_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Any:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=None, scale=scale
    )


def _cuda_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Any:
    return torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, False, False, scale=scale
    )[:2]


def _cuda_efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Any:
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, False, scale=scale
    )[:2]
    return out, lse[..., : q.shape[-2]]  # the log-sum-exp may be padded along the queries


def _cpu_flash_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: torch.Tensor
) -> Any:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=bias, scale=scale
    )


def _cuda_efficient_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: torch.Tensor
) -> Any:
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, False, scale=scale
    )[:2]
    return out, lse[..., : q.shape[-2]]


_FUSED: dict[tuple[str, torch.dtype, int], Any] = {}
_FUSED_CANDIDATES = {"cpu": (_cpu_flash,), "cuda": (_cuda_flash, _cuda_efficient)}
_FUSED_MASKED: dict[tuple[str, torch.dtype, int], Any] = {}
_MASKED_CANDIDATES = {"cpu": (_cpu_flash_masked,), "cuda": (_cuda_efficient_masked,)}


def _fused_kernel(q: torch.Tensor) -> Any:
    """The fused kernel for ``q``'s device type, dtype and head size, or ``None``.

    The first candidate that runs and agrees with :func:`_math_attention` on a small random
    problem (output and log-sum-exp, to the dtype's tolerance) is kept for the process; a
    kernel missing from this torch build, unsupported for the dtype or returning another
    convention is never used.
    """
    key = (q.device.type, q.dtype, q.shape[-1])
    if key not in _FUSED:
        candidates = _FUSED_CANDIDATES.get(q.device.type, ())
        _FUSED[key] = next(
            (f for f in candidates if _kernel_agrees(f, q.dtype, q.device, q.shape[-1])), None
        )
        if _FUSED[key] is None and candidates:
            log.info("no fused attention kernel for %s; using the plain path", key)
    return _FUSED[key]


def _fused_masked_kernel(q: torch.Tensor) -> Any:
    """The fused kernel with an additive mask for ``q``'s device type, dtype and head size, or
    ``None`` (validated like :func:`_fused_kernel`, with a mask that drops about half the keys)."""
    key = (q.device.type, q.dtype, q.shape[-1])
    if key not in _FUSED_MASKED:
        candidates = _MASKED_CANDIDATES.get(q.device.type, ())
        _FUSED_MASKED[key] = next(
            (
                f
                for f in candidates
                if _kernel_agrees(f, q.dtype, q.device, q.shape[-1], masked=True)
            ),
            None,
        )
        if _FUSED_MASKED[key] is None and candidates:
            log.info("no fused masked attention kernel for %s; using the plain path", key)
    return _FUSED_MASKED[key]


def _kernel_agrees(
    kernel: Any, dtype: torch.dtype, device: torch.device, d: int, masked: bool = False
) -> bool:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn((2, 2, s, d), generator=gen).to(device, dtype) for s in (5, 37, 37))
    scale = d**-0.5
    bias = None
    if masked:  # about half the keys dropped, a different half per head and query
        drop = torch.rand((2, 2, 5, 37), generator=gen) < 0.5
        drop[..., 0] = False
        bias = torch.zeros(drop.shape).masked_fill_(drop, float("-inf")).to(device, dtype)
    try:
        out, lse = kernel(q, k, v, scale) if bias is None else kernel(q, k, v, scale, bias)
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError):
        return False
    ref_out, ref_lse = _math_attention(q, k, v, scale, None if bias is None else bias.float())
    tol = 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2
    return (
        tuple(out.shape) == tuple(ref_out.shape)
        and tuple(lse.shape) == tuple(ref_lse.shape)
        and torch.allclose(out.float(), ref_out, atol=tol, rtol=tol)
        and torch.allclose(lse.float(), ref_lse, atol=tol, rtol=tol)
    )


_NATIVE: list[bool] = []  # [] until checked, then [whether the native kernel is used]


def _use_native(prefix: SharedPrefix, q: torch.Tensor) -> bool:
    """Whether ``prefix``'s prompt parts go to the native prompt kernel (:mod:`kvdiverge.
    engine.native`): asked for, float32 on the CPU with one torch thread (the kernel runs on
    one; with more, the library kernels use them), and the kernel built and agreeing with
    :func:`_math_attention` (checked once per process on small problems: masked entries, a row
    with every entry masked, lengths not a multiple of its block)."""
    if not (prefix.native and prefix.fused and q.device.type == "cpu"):
        return False
    if torch.get_num_threads() != 1:
        return False
    if q.dtype != torch.float32 or q.shape[-1] % 16 or q.shape[-1] > 128:
        return False
    if not _NATIVE:
        _NATIVE.append(native.library() is not None and _native_agrees())
        if native.library() is not None and not _NATIVE[0]:
            log.warning("native prompt kernel disagrees with the plain path; not used")
    return _NATIVE[0]


def _native_agrees() -> bool:
    gen = torch.Generator().manual_seed(0)
    for m, n, d in ((7, 37, 64), (13, 130, 16), (5, 200, 128)):
        q, k, v = (torch.randn((2, s, d), generator=gen) for s in (m, n, n))
        drop = torch.rand((2, 2, n), generator=gen) < 0.5
        drop[1, 0] = True  # the second mask drops every entry of the first KV head
        bias = torch.zeros(drop.shape).masked_fill_(drop, float("-inf"))
        rows = torch.arange(m, dtype=torch.int32) % 3 - 1  # no mask, mask 0, mask 1
        full = torch.stack([bias[r] if r >= 0 else torch.zeros(2, n) for r in rows.tolist()], 1)
        try:
            out, lse = native.attend(q, k, v, d**-0.5, bias, rows)
            plain_out, plain_lse = native.attend(q, k, v, d**-0.5)
        except (RuntimeError, OSError):
            return False
        ref_out, ref_lse = _math_attention(q, k, v, d**-0.5, full)
        ref_plain = _math_attention(q, k, v, d**-0.5)
        if not (
            torch.allclose(out, ref_out, atol=1e-5, rtol=1e-5)
            and torch.equal(lse.isinf(), ref_lse.isinf())
            and torch.allclose(lse.nan_to_num(0.0, 0.0, 0.0), ref_lse.nan_to_num(0.0, 0.0, 0.0))
            and torch.allclose(plain_out, ref_plain[0], atol=1e-5, rtol=1e-5)
            and torch.allclose(plain_lse, ref_plain[1], atol=1e-5, rtol=1e-5)
        ):
            return False
    return True


def shared_prefix_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over (shared prompt part) ∪ (each row's own generated part), merged exactly.

    ``query`` (B, H, q, d); ``key``/``value`` (B, H_kv, t, d) are the rows' own entries (from
    :class:`RowCache`, the current one included). The shared prompt part arrives as the
    ``kvd_prefix`` kwarg (:class:`SharedPrefix`); each row group's queries (grouped-query
    heads folded) are scored against its prompt part in one product. Without it this is plain
    SDPA attention. Each part gives a normalised output and its log-sum-exp; the exact softmax
    over the union is their mix with weight sigmoid(lse_prompt − lse_own) (log-sum-exp merge,
    docs/architecture.md, "Shared-prefix attention").
    The signature is transformers' own (``sdpa_attention_forward``'s order: ``dropout`` before
    ``scaling``), so wrappers that pass ``dropout`` by position, as kvpress's does, work.
    Returns (B, q, H, d) like transformers' attention functions.
    """
    prefix: SharedPrefix | None = kwargs.pop("kvd_prefix", None)
    if prefix is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    batch, n_heads, q_len, d = query.shape
    if q_len != 1:
        raise ValueError("shared_prefix_attention decodes one token per row and step")
    n_kv = key.shape[1]
    groups = n_heads // n_kv
    scale = float(scaling if scaling is not None else d**-0.5)
    q = query.reshape(batch, n_kv, groups, d)
    # (B, H_kv, G, d), (B, H_kv, G)
    o_own, lse_own = _attention_with_lse(q, key, value, scale, prefix.fused)
    o_pre = torch.empty_like(o_own)
    lse_pre = torch.empty_like(lse_own)
    in_pass = set()
    use_native = _use_native(prefix, q)
    for part in prefix.passes:
        in_pass.update(part.groups)
        _masked_pass(part, prefix, module.layer_idx, q, o_pre, lse_pre, scale, use_native)
    for g, (rows, prompt) in enumerate(zip(prefix.rows, prefix.prompts, strict=True)):
        if g in in_pass:
            continue
        pk, pv, *mask = prompt[module.layer_idx]
        n_rows = rows.numel()
        if n_rows == 0:  # every row of this group has ended
            continue
        qg = q.index_select(0, rows).transpose(0, 1).reshape(1, n_kv, n_rows * groups, d)
        if use_native:  # a ragged part's padding masked out by a bias shared by its rows
            bias = row_bias = None
            if mask:
                bias = torch.zeros((1, *mask[0].shape), dtype=torch.float32)
                bias[0].masked_fill_(~mask[0], float("-inf"))
                row_bias = torch.zeros(n_rows * groups, dtype=torch.int32)
            o, lse = native.attend(qg[0], pk, pv, scale, bias, row_bias)
        elif mask:  # ragged KV heads: the padding masked out, on the plain path
            bias = torch.zeros(mask[0].shape, dtype=torch.float32, device=mask[0].device)
            bias = bias.masked_fill_(~mask[0], float("-inf"))[None, :, None, :]
            o, lse = _math_attention(qg, pk[None], pv[None], scale, bias)
        else:
            o, lse = _attention_with_lse(qg, pk[None], pv[None], scale, prefix.fused)
        o_pre.index_copy_(0, rows, o.reshape(n_kv, n_rows, groups, d).transpose(0, 1))
        lse_pre.index_copy_(0, rows, lse.reshape(n_kv, n_rows, groups).transpose(0, 1))
    # Each row's weights are padded to a multiple of 64 lanes so that the vectorised sigmoid
    # treats every row alike: torch's CPU loop runs blocks of two vectors (32 floats with
    # AVX-512) and a scalar tail that rounds differently, so with rows of 16 lanes the last row
    # of an odd batch took the tail and the full control lost its bit-exactness.
    diff = (lse_pre - lse_own).reshape(batch, n_heads)
    diff = torch.nn.functional.pad(diff, (0, (-n_heads) % 64))
    weight = torch.sigmoid(diff)[:, :n_heads].reshape(batch, n_kv, groups, 1)
    out = o_own + weight * (o_pre - o_own)
    return out.reshape(batch, n_heads, 1, d).transpose(1, 2).to(query.dtype), None


def _masked_pass(
    part: PromptPass,
    prefix: SharedPrefix,
    layer: int,
    q: torch.Tensor,
    o_pre: torch.Tensor,
    lse_pre: torch.Tensor,
    scale: float,
    use_native: bool = False,
) -> None:
    """The rows of ``part``'s groups against the full prompt of ``layer`` in one product, each
    group's evicted entries masked out; their outputs and log-sum-exps into ``o_pre``/``lse_pre``.

    With ``use_native`` the native prompt kernel takes the groups' (H_kv, n) masks as they are
    (:meth:`PromptPass.bias_table`, a row index per query); otherwise:
    ``q`` (B, H_kv, G, d): every batch row's queries, grouped-query heads folded. The additive
    mask (H_kv, rows·G, n) is built from each group's (H_kv, n) mask (no mask when every group
    keeps everything); a fused kernel that takes it runs where one is validated, else the plain
    float32 path (always when a KV head of some group keeps nothing)."""
    chosen = [(i, prefix.rows[g]) for i, g in enumerate(part.groups) if prefix.rows[g].numel()]
    if not chosen:  # every row of these groups has ended
        return
    _, n_kv, groups, d = q.shape
    rows = torch.cat([r for _, r in chosen])
    n_rows = rows.numel()
    pk, pv = part.prompt[layer]
    qg = q.index_select(0, rows).transpose(0, 1).reshape(1, n_kv, n_rows * groups, d)
    if use_native:
        table = part.bias_table(layer)
        row_bias = None
        if table is not None:
            index = torch.tensor([part.bias_rows[i] for i, _ in chosen], dtype=torch.int32)
            counts = torch.tensor([r.numel() * groups for _, r in chosen])
            row_bias = index.repeat_interleave(counts)
        o, lse = native.attend(qg[0], pk, pv, scale, table, row_bias)
    elif all(part.biases[i] is None for i, _ in chosen):
        o, lse = _attention_with_lse(qg, pk[None], pv[None], scale, prefix.fused)
    else:
        n = pk.shape[-2]
        zero = pk.new_zeros((n_kv, 1, 1, n), dtype=torch.float32)
        bias = torch.cat(
            [
                (zero if part.biases[i] is None else part.biases[i][layer][:, None, None]).expand(
                    n_kv, r.numel(), groups, n
                )
                for i, r in chosen
            ],
            dim=1,
        ).reshape(1, n_kv, n_rows * groups, n)
        kernel = _fused_masked_kernel(qg) if prefix.fused and not part.empty_head else None
        o = lse = None
        if kernel is not None:
            try:
                o, lse = kernel(qg, pk[None], pv[None], scale, bias.to(qg.dtype))
                o, lse = o.float(), lse.float()
            except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
                key = (qg.device.type, qg.dtype, d)
                log.warning("fused masked attention %s failed (%s); using the plain path", key, exc)
                _FUSED_MASKED[key] = None
                o = lse = None
        if o is None:
            o, lse = _math_attention(qg, pk[None], pv[None], scale, bias)
    o_pre.index_copy_(0, rows, o.reshape(n_kv, n_rows, groups, d).transpose(0, 1))
    lse_pre.index_copy_(0, rows, lse.reshape(n_kv, n_rows, groups).transpose(0, 1))


AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention)


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Run ``model`` with the registered attention function ``name`` inside the block."""
    old = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(old)
