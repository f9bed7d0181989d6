"""The coupled rollout engine: batched stepwise maximal coupling with a shared prompt cache.

Implements SPEC §1, §5 (rollouts), §6 (common random numbers) with the architecture of
DESIGN §4:

* one prefill per document gives the full prompt cache and the first-token logits (shared by
  the reference P and every intervention Q, so δ_1 = 0), whatever the number of actions;
* each action's selector gathers its kept entries from that cache once per document;
* all replicates and streams of a document decode as ONE batch, one model call per step:
  the reference X rows on the full prompt cache, then for each evicting action its
  intervention rows Y on its evicted cache, then the fixed-history rows Z (Q fed X's tokens,
  for f_t) of the replicates whose histories have split. The X rows are shared by every
  action with the same replicates (:func:`reference_groups`): one job runs all of a study's
  actions, and each step reads the model's weights once for all of them;
* the prompt cache is shared by every row, never copied per replicate: a custom attention
  function (registered with transformers' ``AttentionInterface``) scores each row group's
  queries against its shared prompt part in one batched product (grouped-query heads folded), scores
  each row's own generated entries (a cache that holds only those) separately, and merges the
  two exactly with a common max (log-sum-exp). Memory is O(prompt + K·H) per action;
* the stepwise maximal coupling (``kvdiverge.coupling.maximal_coupling_step``, accept sampler)
  runs every step with common random numbers: X by inverse CDF from the REFERENCE stream, keyed
  by (seed, document, replicate, t) only, so X is identical across actions; ACCEPT and RESIDUAL
  streams for Y. ``coupling="independent"`` salts all streams with the action name (each action
  then has its own X rows);
* temperature 1, full softmax (float64); the EOS ids are ONE outcome of every kernel
  (:func:`kvdiverge.coupling.merge_eos`: their probabilities are summed onto the smallest EOS
  id before the TV and the coupling, so two sequences that both end agree, whatever id each
  would have used, and results do not depend on the order of ``eos_ids``); an EOS outcome is
  recorded as that smallest id; EOS is absorbing (after it a sequence's kernel is the point
  mass on the merged outcome); H steps always; rows whose stream has ended leave the batch (a
  quarter of it at a time);
* on CUDA out-of-memory the replicate batch is split in halves and the rollout goes on.

An action that keeps everything (the full-retention control) runs through the same path as
any evicting action: its cache is a gather of every position, its Y rows decode over it and
its Q is computed from their own logits, so the control exercises the gather, the
shared-prefix attention and the coupling and can fail (on CPU float32 it gives δ ≡ f ≡ 0 and
X ≡ Y exactly). ``identity_shortcut=True`` (for benchmarks only) skips those rows and sets
Q := P. Reruns are bit-identical. An action run with others
shares its model calls with their rows, so its values equal a run of that action alone to
floating-point rounding (the matrix products' batch differs), not bit for bit; the tokens
differ only where a uniform falls within rounding of a CDF boundary. A replicate's Z row runs only
after its X and Y histories split: until then Z is Y (the same tokens on the same cache), so
its Q is Y's, copied bit for bit, and at the split the Z row starts from a copy of Y's
generated entries. Before divergence an action therefore costs one row per replicate, not two.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvdiverge.coupling import (
    Stream,
    canonical_eos,
    crn_uniforms,
    document_key,
    maximal_coupling_step,
    merge_eos,
    tv,
)
from kvdiverge.eviction import (
    SELECTORS,
    ActionSpec,
    Prefill,
    parse_action,
    run_prefill,
    select_positions,
)
from kvdiverge.trajectories import TRAJECTORY_SCHEMA

__all__ = [
    "ATTENTION_NAME",
    "DocumentRollout",
    "RowCache",
    "SharedPrefix",
    "TIMING_KEYS",
    "reference_groups",
    "rollout_document",
    "rollout_document_actions",
    "rollout_documents",
    "rollout_documents_actions",
    "run_rollout_job",
    "run_stratum_rollout_job",
    "select_documents",
    "select_job_documents",
    "shared_prefix_attention",
    "trajectory_frame",
]

log = logging.getLogger(__name__)

ATTENTION_NAME = "kvdiverge_shared_prefix"
TIMING_KEYS = ("documents", "paths", "prefill_seconds", "selection_seconds", "decode_seconds")
COUPLING_MODES = ("shared-reference", "independent")


@dataclass
class SharedPrefix:
    """The shared prompt parts of a model call (passed as the ``kvd_prefix`` kwarg).

    Row group g — the batch rows ``rows[g]`` (a LongTensor) — attends to the prompt part
    ``prompts[g][l] = (keys, values)`` of layer l, each of shape (H_kv, n_g, d): the full cache
    for the X rows, an action's evicted cache for its Y and Z rows. A prompt part is one tensor
    for all its rows, never copied per row (DESIGN §4).
    """

    rows: list[torch.Tensor]
    prompts: list[list[tuple[torch.Tensor, torch.Tensor]]]


class RowCache:
    """Decode cache holding only each row's own generated entries (DESIGN §4).

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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of (…, s, d) queries over (…, n, d) keys: (output, log-sum-exp).

    Scores, softmax and the weighted sum run in float32 whatever the model dtype (bf16 scores
    would lose the precision SDPA keeps internally).
    """
    s, n = q.shape[-2], k.shape[-2]
    chunk = max(1, _MAX_SCORES // max(1, n * q[..., :1, :1].numel()))
    if s > chunk:  # bound the transient score matrix: split the queries
        parts = [_math_attention(q[..., i : i + chunk, :], k, v, scale) for i in range(0, s, chunk)]
        return torch.cat([p[0] for p in parts], dim=-2), torch.cat([p[1] for p in parts], dim=-1)
    scores = torch.matmul(q.float() * scale, k.float().transpose(-1, -2))
    m = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(m).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights, v.float()) / total
    return out, (m + total.log()).squeeze(-1)


def _attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, h, s, d) × (B, h, n, d) → normalised output (float32) and log-sum-exp (B, h, s).

    A fused attention kernel that also returns the log-sum-exp where one is available and
    validated for the device and dtype (:func:`_fused_kernel`: CPU flash attention; on CUDA
    flash attention for fp16/bf16, else memory-efficient attention), otherwise the plain
    matmul–softmax path. The fused kernels never hold the score matrix.
    """
    kernel = _fused_kernel(q) if _FUSED_ENABLED[0] else None
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


_FUSED_ENABLED = [True]
_DROP_ENDED = [True]  # rows whose stream has ended leave the batch (off: benchmarks compare)
_FUSED: dict[tuple[str, torch.dtype, int], Any] = {}
_FUSED_CANDIDATES = {"cpu": (_cpu_flash,), "cuda": (_cuda_flash, _cuda_efficient)}


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


def _kernel_agrees(kernel: Any, dtype: torch.dtype, device: torch.device, d: int) -> bool:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn((2, 2, s, d), generator=gen).to(device, dtype) for s in (5, 37, 37))
    scale = d**-0.5
    try:
        out, lse = kernel(q, k, v, scale)
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError):
        return False
    ref_out, ref_lse = _math_attention(q, k, v, scale)
    tol = 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2
    return (
        tuple(out.shape) == tuple(ref_out.shape)
        and tuple(lse.shape) == tuple(ref_lse.shape)
        and torch.allclose(out.float(), ref_out, atol=tol, rtol=tol)
        and torch.allclose(lse.float(), ref_lse, atol=tol, rtol=tol)
    )


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
    DESIGN §4).
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
    o_own, lse_own = _attention_with_lse(q, key, value, scale)  # (B, H_kv, G, d), (B, H_kv, G)
    o_pre = torch.empty_like(o_own)
    lse_pre = torch.empty_like(lse_own)
    for rows, prompt in zip(prefix.rows, prefix.prompts, strict=True):
        pk, pv = prompt[module.layer_idx]
        n_rows = rows.numel()
        if n_rows == 0:  # every row of this group has ended
            continue
        qg = q.index_select(0, rows).transpose(0, 1).reshape(1, n_kv, n_rows * groups, d)
        o, lse = _attention_with_lse(qg, pk[None], pv[None], scale)
        o_pre.index_copy_(0, rows, o.reshape(n_kv, n_rows, groups, d).transpose(0, 1))
        lse_pre.index_copy_(0, rows, lse.reshape(n_kv, n_rows, groups).transpose(0, 1))
    # Each row's weights are padded to a multiple of 16 lanes so that the vectorised sigmoid
    # treats every row alike (a CPU kernel's scalar tail could otherwise round the last rows
    # differently, and the full control would no longer reproduce the reference bit for bit).
    diff = (lse_pre - lse_own).reshape(batch, n_heads)
    diff = torch.nn.functional.pad(diff, (0, (-n_heads) % 16))
    weight = torch.sigmoid(diff)[:, :n_heads].reshape(batch, n_kv, groups, 1)
    out = o_own + weight * (o_pre - o_own)
    return out.reshape(batch, n_heads, 1, d).transpose(1, 2).to(query.dtype), None


AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention)


@contextlib.contextmanager
def _attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    old = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(old)


def _check_model(model: torch.nn.Module, n: int, H: int) -> None:
    for layer in model.model.layers:
        window = getattr(layer.self_attn, "sliding_window", None)
        if window is not None and window < n + H:
            raise ValueError(
                f"model: layer uses sliding-window attention ({window} < {n + H} positions); "
                "the engine needs full attention"
            )


@dataclass
class DocumentRollout:
    """One document's coupled rollouts (SPEC §1), arrays of shape (K, H) (logits: (K, H, V))."""

    doc_id: str
    replicates: np.ndarray
    x_token: np.ndarray
    y_token: np.ndarray
    tv_rollout: np.ndarray
    tv_fixed: np.ndarray
    x_eos: np.ndarray
    y_eos: np.ndarray
    n_prompt: int
    n_kept: int
    batch_rows: int = 0  # the most rows a model call could hold (largest chunk ran)
    rows_per_replicate: int = 3  # X, and Y and Z per evicting action of the reference group
    logits: dict[str, np.ndarray] | None = None
    prefill_seconds: float = 0.0
    selection_seconds: float = 0.0
    decode_seconds: float = 0.0


def _clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` is done (CUDA is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(iter(model.parameters()), torch.empty(0)).device


def _uniforms(
    seed: int, doc_key: int, replicates: np.ndarray, H: int, salt: int, device: torch.device
) -> torch.Tensor:
    """The coupling's uniforms for every replicate and step: (H, K, 3) on ``device``.

    Streams REFERENCE, ACCEPT, RESIDUAL (SPEC §6), keyed by (seed, document, replicate, t).
    """
    steps = np.arange(1, H + 1)[:, None]
    u = np.stack(
        [
            crn_uniforms(seed, doc_key, replicates[None, :], steps, stream, salt)
            for stream in (Stream.REFERENCE, Stream.ACCEPT, Stream.RESIDUAL)
        ],
        axis=-1,
    )
    return torch.from_numpy(u).to(device)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


@dataclass
class _Intervention:
    """One action's evicted prompt part in a decoding chunk (``None``: Q is P, no rows run)."""

    prefix: list[tuple[torch.Tensor, torch.Tensor]] | None


def _decode_step(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    position: int,
    cache: RowCache,
    shared: SharedPrefix,
) -> torch.Tensor:
    """One batched decoding step of ``tokens`` (B,) at prompt offset ``position``: logits (B, V)."""
    result = model(
        input_ids=tokens[:, None],
        # every row decodes at the same position: one rotary row broadcasts over the batch
        position_ids=torch.full((1, 1), position, dtype=torch.long, device=tokens.device),
        cache_position=torch.tensor([cache.get_seq_length()], device=tokens.device),
        past_key_values=cache,
        use_cache=True,
        kvd_prefix=shared,
    )
    return result.logits[:, -1]


@torch.inference_mode()
def _rollout_chunk(
    model: torch.nn.Module,
    prefill: Prefill,
    prefix_full: list[tuple[torch.Tensor, torch.Tensor]],
    interventions: Sequence[_Intervention],
    replicates: np.ndarray,
    doc_key: int,
    H: int,
    seed: int,
    eos_ids: Sequence[int],
    salt: int,
    keep_logits: bool,
) -> list[dict[str, np.ndarray]]:
    """Coupled rollouts of ``replicates`` under every intervention, sharing one X stream.

    Each step runs ONE model call for all running rows (DESIGN §4): the k reference rows X
    (full prompt cache), each evicted intervention's k Y rows, and the Z rows (Q fed X's
    tokens, for f_t; on the intervention's evicted cache) of the (intervention, replicate)
    pairs whose X and Y histories have split, added in the order they split. Before its split
    a replicate's Z is Y itself (the same cache, the same tokens), so Q on X's history is Y's
    Q, bit for bit, and no row runs for it; at the split the Z row starts from a copy of the
    Y row's generated entries. An intervention with ``prefix=None`` keeps everything: its Q
    is P itself (δ ≡ f ≡ 0, Y ≡ X) and it runs no rows.

    A row whose stream has ended no longer matters: an X row once X emitted EOS, a Y row once
    Y did, a Z row once X did (from then on the kernel is the point mass on EOS). Ended rows
    leave the batch when they make up a quarter of it (the running rows' generated entries
    are then moved to the front); until then they run and their logits are ignored. With
    ``keep_logits`` every row stays, so that every stream's logits are recorded.
    """
    device = prefill.last_logits.device
    k = len(replicates)
    n = prefill.n
    n_layers = len(prefill.keys)
    n_kv, _, d = prefill.keys[0].shape
    dtype = prefill.keys[0].dtype
    evicted = [i for i, act in enumerate(interventions) if act.prefix is not None]
    n_streams = 1 + 2 * len(evicted)  # stream codes: 0 = X; 1 + 2j = Y, 2 + 2j = Z of evicted[j]
    y_code = {i: 1 + 2 * j for j, i in enumerate(evicted)}
    cache = RowCache(n_layers, k * n_streams, n_kv, d, max(H - 1, 1), dtype, device)
    reps = torch.arange(k, device=device)
    # the batch's rows: their stream code and replicate (X and Y rows first, Z rows appended)
    row_stream = torch.arange(1 + len(evicted), device=device).repeat_interleave(k)
    row_stream = torch.where(row_stream > 0, 2 * row_stream - 1, 0)
    row_rep = reps.repeat(1 + len(evicted))
    cache.rows = row_stream.numel()
    prompts = [list(prefix_full)] + [list(interventions[i].prefix) for i in evicted]
    z_started = {i: torch.zeros(k, dtype=torch.bool, device=device) for i in evicted}

    def layout() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], SharedPrefix]:
        """Per stream code: (batch rows, their replicates); the call's prompt row groups."""
        members = [(row_stream == s).nonzero()[:, 0] for s in range(n_streams)]
        streams = [(rows, row_rep[rows]) for rows in members]
        group = (row_stream + 1) // 2  # X → prompt 0, Y and Z of evicted[j] → prompt 1 + j
        rows = [(group == g).nonzero()[:, 0] for g in range(len(prompts))]
        return streams, SharedPrefix(rows, prompts)

    streams, shared = layout()
    eos = torch.tensor(sorted({int(e) for e in eos_ids}), device=device)
    canonical = canonical_eos(eos_ids)
    first = prefill.last_logits.float()
    vocab = first.shape[-1]
    point_mass = torch.zeros(vocab, dtype=torch.float64, device=device)
    point_mass[canonical] = 1.0

    fields = (
        ("y_token", torch.long),
        ("tv_rollout", torch.float64),
        ("tv_fixed", torch.float64),
        ("y_eos", torch.bool),
    )
    out = [
        {name: torch.empty((k, H), dtype=kind, device=device) for name, kind in fields}
        for _ in interventions
    ]
    x_token = torch.empty((k, H), dtype=torch.long, device=device)
    x_eos = torch.empty((k, H), dtype=torch.bool, device=device)
    kept_logits: list[dict[str, list[torch.Tensor]]] = [
        {"p": [], "q": [], "q_fixed": []} for _ in interventions
    ]
    uniforms = _uniforms(seed, doc_key, replicates, H, salt, device)
    x_done = torch.zeros(k, dtype=torch.bool, device=device)
    y_done = [torch.zeros(k, dtype=torch.bool, device=device) for _ in interventions]
    split = [torch.zeros(k, dtype=torch.bool, device=device) for _ in interventions]
    logits = first.expand(cache.rows, vocab)  # this step's logits of every batch row

    def absorbed(kernel: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """The kernel with the point mass on EOS in the rows that have emitted EOS."""
        return torch.where(done[:, None], point_mass, kernel) if bool(done.any()) else kernel

    def per_replicate(rows: torch.Tensor, code: int, base: torch.Tensor | None = None):
        """Stream ``code``'s (k, V) rows by replicate, from ``base`` where it has no row (an
        ended row, or a Z not yet split), else zeros (a point mass replaces them)."""
        batch_rows, row_reps = streams[code]
        if base is None and batch_rows.numel() == k and bool((row_reps == reps).all()):
            return rows.index_select(0, batch_rows)
        start = torch.zeros((k, rows.shape[-1]), dtype=rows.dtype, device=device)
        return (start if base is None else base).index_copy(
            0, row_reps, rows.index_select(0, batch_rows)
        )

    with _attention_implementation(model, ATTENTION_NAME):
        for t in range(1, H + 1):
            probs = merge_eos(logits.double().softmax(dim=-1), eos_ids, inplace=True)
            p_raw = per_replicate(probs, 0)
            p = absorbed(p_raw, x_done)
            x = None
            for i in range(len(interventions)):
                if i in y_code:
                    q_raw = per_replicate(probs, y_code[i])
                    q_fixed_raw = per_replicate(probs, y_code[i] + 1, base=q_raw)
                else:  # nothing evicted: Q is P as a kernel
                    q_raw = q_fixed_raw = p_raw
                if keep_logits:
                    lp = per_replicate(logits, 0)
                    lq = per_replicate(logits, y_code[i]) if i in y_code else lp
                    lz = per_replicate(logits, y_code[i] + 1, base=lq) if i in y_code else lp
                    for name, part in zip(("p", "q", "q_fixed"), (lp, lq, lz), strict=True):
                        kept_logits[i][name].append(part.float().cpu())
                q = absorbed(q_raw, y_done[i])
                q_fixed = absorbed(q_fixed_raw, x_done)
                x_i, y = maximal_coupling_step(p, q, uniforms[t - 1])
                x = x_i if x is None else x  # X ~ p by inverse CDF: the same for every q
                y_done[i] = y_done[i] | torch.isin(y, eos)
                out[i]["y_token"][:, t - 1] = y
                out[i]["tv_rollout"][:, t - 1] = tv(p, q)
                out[i]["tv_fixed"][:, t - 1] = tv(p, q_fixed)
                out[i]["y_eos"][:, t - 1] = y_done[i]
                split[i] = split[i] | (x != y)
            if x is None:  # no intervention: X alone
                x = maximal_coupling_step(p, p, uniforms[t - 1])[0]
            x_done = x_done | torch.isin(x, eos)
            x_token[:, t - 1] = x
            x_eos[:, t - 1] = x_done
            if t == H:
                break
            changed = False
            for i in evicted:  # newly split, X running: the Z row starts from Y's history
                running = ~x_done | keep_logits  # (kept logits: every Z law is recorded)
                new = (split[i] & ~z_started[i] & running).nonzero()[:, 0]
                z_started[i] = split[i].clone()
                if new.numel():
                    y_rows, y_reps = streams[y_code[i]]
                    source = torch.full((k,), -1, dtype=torch.long, device=device)
                    source[y_reps] = y_rows
                    slots = torch.arange(cache.rows, cache.rows + new.numel(), device=device)
                    cache.copy_rows(source[new], slots)
                    cache.rows += new.numel()
                    row_stream = torch.cat([row_stream, torch.full_like(new, y_code[i] + 1)])
                    row_rep = torch.cat([row_rep, new])
                    changed = True
            ended = torch.stack([x_done] + [e for i in evicted for e in (y_done[i], x_done)])[
                row_stream, row_rep
            ]
            n_ended = int(ended.sum())
            if not keep_logits and _DROP_ENDED[0] and n_ended and 4 * n_ended >= ended.numel():
                running = (~ended).nonzero()[:, 0]
                cache.keep_rows(running)
                row_stream, row_rep = row_stream[running], row_rep[running]
                changed = True
            if changed:
                streams, shared = layout()
            if cache.rows == 0:  # every stream has ended: point masses from here on
                logits = first.new_zeros((0, vocab))
                continue
            tokens = torch.stack(
                [x] + [s for i in evicted for s in (out[i]["y_token"][:, t - 1], x)]
            )[row_stream, row_rep]
            logits = _decode_step(model, tokens, n + t - 1, cache, shared)
    x_arrays = {"x_token": x_token.cpu().numpy(), "x_eos": x_eos.cpu().numpy()}
    results = []
    for i, fields_i in enumerate(out):
        arrays = {**x_arrays, **{name: v.cpu().numpy() for name, v in fields_i.items()}}
        if keep_logits:
            for name, parts in kept_logits[i].items():
                arrays[f"logits_{name}"] = torch.stack(parts, dim=1).numpy()
        results.append(arrays)
    return results


def _rollout_replicates(
    replicates: np.ndarray, run: Any, max_rows: int, rows_per_replicate: int
) -> tuple[list[Any], int]:
    """Run ``run`` on chunks of at most ``max_rows // rows_per_replicate`` replicates (at least
    one); halve a chunk on out-of-memory.

    Returns the results in replicate order and the largest chunk size that ran.
    """
    chunk = max(1, max_rows // rows_per_replicate)
    pending = [replicates[i : i + chunk] for i in range(0, len(replicates), chunk)]
    results = []
    fitted = 0
    while pending:
        part = pending.pop(0)
        try:
            results.append(run(part))
            fitted = max(fitted, len(part))
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not _is_oom(exc) or len(part) == 1:
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            half = len(part) // 2
            log.warning("out of memory with %d replicates; splitting into halves", len(part))
            pending[:0] = [part[:half], part[half:]]
    return results, fitted


def _running_row_steps(arrays: Mapping[str, np.ndarray]) -> tuple[int, int]:
    """Row-steps of running rows in the H − 1 decoding steps: the X rows' (until X's EOS), and
    an evicting action's own: its Y rows' (until Y's EOS) and its Z rows' (after the split,
    until X's EOS). Ended rows may run a few steps more before they leave the batch."""
    x_running = ~arrays["x_eos"][:, :-1]
    split = np.logical_or.accumulate(arrays["x_token"] != arrays["y_token"], axis=1)[:, :-1]
    own = (~arrays["y_eos"][:, :-1]).sum() + (split & x_running).sum()
    return int(x_running.sum()), int(own)


def _gather_prefix(prefill: Prefill, kept: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for layer, (keys, values) in enumerate(zip(prefill.keys, prefill.values, strict=True)):
        index = kept[layer][..., None].expand(-1, -1, keys.shape[-1])
        out.append((keys.gather(1, index), values.gather(1, index)))
    return out


def _replicate_indices(replicates: int | Sequence[int] | np.ndarray) -> np.ndarray:
    reps = np.arange(replicates) if isinstance(replicates, int) else np.asarray(replicates)
    return reps.astype(np.int64)


def _check_rollout_args(coupling: str, H: int, eos_ids: Sequence[int]) -> None:
    if coupling not in COUPLING_MODES:
        raise ValueError(f"coupling: expected one of {', '.join(COUPLING_MODES)}, got {coupling!r}")
    if H < 1:
        raise ValueError(f"H: expected an integer >= 1, got {H}")
    if not eos_ids:
        raise ValueError("eos_ids: at least one EOS token id is needed")


def reference_groups(
    actions: Sequence[ActionSpec], replicates: Mapping[str, np.ndarray], coupling: str
) -> list[tuple[int, tuple[int, ...], list[int]]]:
    """Actions that share one reference stream X: ``(salt, replicates, action indices)``.

    Under common random numbers (SPEC §6) X depends only on (seed, document, replicate, t), so
    the actions with the same replicate indices share one X batch (the full-retention control,
    with its own K_control, gets its own). ``independent`` salts every action's streams with
    its name, so each action has its own X.
    """
    groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for i, action in enumerate(actions):
        salt = 0 if coupling == "shared-reference" else document_key(f"action:{action.name}")
        key = (salt, tuple(int(r) for r in replicates[action.name]))
        groups.setdefault(key, []).append(i)
    return [(salt, reps, members) for (salt, reps), members in groups.items()]


def rollout_document_actions(
    model: torch.nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    actions: Sequence[ActionSpec | Mapping[str, Any]],
    doc_id: str,
    replicates: int | Sequence[int] | Mapping[str, int | Sequence[int]],
    H: int,
    seed: int,
    eos_ids: Sequence[int],
    coupling: str = "shared-reference",
    max_batch_rows: int = 192,
    keep_logits: bool = False,
    prefill: Prefill | None = None,
    identity_shortcut: bool = False,
) -> dict[str, DocumentRollout]:
    """Coupled rollouts of one document under several actions (SPEC §1, §6; DESIGN §4).

    ONE prefill serves every action (full cache and first-token logits); each action gathers
    its kept entries from it. Actions with the same replicates share one reference stream X
    (:func:`reference_groups`); each evicting action adds its Y and Z rows. ``replicates``: K
    or explicit indices for every action, or a mapping action name → K or indices (e.g. the
    control's K_control). All rows of a reference group run in one model call per step, so an
    action's result equals :func:`rollout_document` with that action alone to floating-point
    rounding (the batch differs). Returns ``{action name: DocumentRollout}``.

    ``input_ids``: the chat-wrapped prompt (:func:`kvdiverge.models.chat_prompt_ids`);
    ``eos_ids``: EOS token ids, one merged outcome (:func:`kvdiverge.coupling.merge_eos`).
    ``keep_logits`` also returns the per-step logits of P (X rows), Q (Y rows) and Q on X's
    history (Z rows), for tests; it keeps every row in the batch, also after its stream has
    ended. A ``prefill`` from :func:`kvdiverge.eviction.run_prefill` may be passed in.

    An action that keeps every prompt entry (``full``, or a budget ≥ n) runs like any other:
    its Y/Z rows decode over the gathered full cache, so the full-retention control tests the
    gather, the attention and the coupling. ``identity_shortcut=True`` (benchmarks only) sets
    Q and the fixed-history Q to P itself instead, so δ ≡ f ≡ 0 and Y ≡ X by construction, and
    no Y/Z rows run.

    Each result also carries wall-clock seconds (``time.perf_counter``, after a CUDA
    synchronize; they change no value): ``prefill_seconds`` of the document's one prefill (the
    same for every action, 0 when ``prefill`` is passed in), the action's own
    ``selection_seconds`` (selection and gather), and ``decode_seconds``: its reference group's
    decode seconds × the row-steps the action would run alone (its running rows': X's, its Y
    rows', its Z rows' after each split; X's only for an exact identity) / the row-steps the
    group ran (the shared X once), i.e. the decode cost of an evaluation run of the action
    alone at the group's cost per row-step.
    """
    _check_rollout_args(coupling, H, eos_ids)
    specs = [a if isinstance(a, ActionSpec) else parse_action(a) for a in actions]
    names = [a.name for a in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"actions: names must be unique, got {', '.join(names)}")
    if isinstance(replicates, Mapping):
        missing = [name for name in names if name not in replicates]
        if missing:
            raise ValueError(f"replicates: no replicate count for action(s) {', '.join(missing)}")
        reps = {name: _replicate_indices(replicates[name]) for name in names}
    else:
        reps = {name: _replicate_indices(replicates) for name in names}
    device = _model_device(model)
    prefill_seconds = 0.0
    if prefill is None:
        window = max(SELECTORS[a.selector].query_window(a) for a in specs)
        start = _clock(device)
        prefill = run_prefill(model, input_ids, window)
        prefill_seconds = _clock(device) - start
    _check_model(model, prefill.n, H)
    kept: dict[str, torch.Tensor] = {}
    interventions: list[_Intervention] = []
    selection_seconds: dict[str, float] = {}
    for a in specs:  # selection and gather, timed per action
        start = _clock(device)
        kept[a.name] = select_positions(prefill, a)
        identity = identity_shortcut and kept[a.name].shape[-1] == prefill.n
        interventions.append(
            _Intervention(None if identity else _gather_prefix(prefill, kept[a.name]))
        )
        selection_seconds[a.name] = _clock(device) - start
    prefix_full = list(zip(prefill.keys, prefill.values, strict=True))
    doc_key = document_key(doc_id)
    results: dict[str, DocumentRollout] = {}
    for salt, group_reps, members in reference_groups(specs, reps, coupling):

        def run(part: np.ndarray, members: list[int] = members, salt: int = salt) -> list[dict]:
            return _rollout_chunk(
                model,
                prefill,
                prefix_full,
                [interventions[i] for i in members],
                part,
                doc_key,
                H,
                seed,
                eos_ids,
                salt,
                keep_logits,
            )

        # batch rows per replicate: X, and each evicting member's Y and (at most) Z
        per_replicate = 1 + 2 * sum(interventions[i].prefix is not None for i in members)
        start = _clock(device)
        parts, fitted = _rollout_replicates(
            np.asarray(group_reps, dtype=np.int64), run, max_batch_rows, per_replicate
        )
        group_seconds = _clock(device) - start
        merged_parts = [
            {name: np.concatenate([p[j][name] for p in parts]) for name in parts[0][j]}
            for j in range(len(members))
        ]
        # row-steps the group's model calls ran: X's (shared), each member's Y and Z rows
        x_rows = _running_row_steps(merged_parts[0])[0]
        own = [
            0 if interventions[i].prefix is None else _running_row_steps(merged)[1]
            for i, merged in zip(members, merged_parts, strict=True)
        ]
        group_rows = x_rows + sum(own)
        for j, i in enumerate(members):
            merged = merged_parts[j]
            logits = {n[len("logits_") :]: v for n, v in merged.items() if n.startswith("logits_")}
            results[specs[i].name] = DocumentRollout(
                doc_id=doc_id,
                replicates=reps[specs[i].name],
                x_token=merged["x_token"],
                y_token=merged["y_token"],
                tv_rollout=merged["tv_rollout"],
                tv_fixed=merged["tv_fixed"],
                x_eos=merged["x_eos"],
                y_eos=merged["y_eos"],
                n_prompt=prefill.n,
                n_kept=int(kept[specs[i].name].shape[-1]),
                batch_rows=per_replicate * fitted,
                rows_per_replicate=per_replicate,
                logits=logits or None,
                prefill_seconds=prefill_seconds,
                selection_seconds=selection_seconds[specs[i].name],
                decode_seconds=group_seconds * (x_rows + own[j]) / max(group_rows, 1),
            )
    return {name: results[name] for name in names}


def rollout_document(
    model: torch.nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    action: ActionSpec | Mapping[str, Any],
    doc_id: str,
    replicates: int | Sequence[int],
    H: int,
    seed: int,
    eos_ids: Sequence[int],
    coupling: str = "shared-reference",
    max_batch_rows: int = 192,
    keep_logits: bool = False,
    prefill: Prefill | None = None,
    identity_shortcut: bool = False,
) -> DocumentRollout:
    """Coupled rollouts of one document under one action (SPEC §1, §6; DESIGN §4).

    :func:`rollout_document_actions` with a single action (same arguments, same values).
    """
    action = action if isinstance(action, ActionSpec) else parse_action(action)
    return rollout_document_actions(
        model,
        input_ids,
        [action],
        doc_id,
        replicates,
        H,
        seed,
        eos_ids,
        coupling,
        max_batch_rows,
        keep_logits,
        prefill,
        identity_shortcut,
    )[action.name]


def trajectory_frame(rollouts: Iterable[DocumentRollout]) -> pl.DataFrame:
    """Long table of DESIGN §3.2: one row per (document, replicate, step)."""
    frames = []
    for r in rollouts:
        k, h = r.x_token.shape
        frames.append(
            pl.DataFrame(
                {
                    "doc_id": np.repeat(np.array([r.doc_id], dtype=object), k * h),
                    "replicate": np.repeat(r.replicates, h),
                    "t": np.tile(np.arange(1, h + 1), k),
                    "x_token": r.x_token.reshape(-1),
                    "y_token": r.y_token.reshape(-1),
                    "mismatch": (r.x_token != r.y_token).reshape(-1),
                    "tv_rollout": r.tv_rollout.reshape(-1),
                    "tv_fixed": r.tv_fixed.reshape(-1),
                    "x_eos": r.x_eos.reshape(-1),
                    "y_eos": r.y_eos.reshape(-1),
                    "n_prompt": np.full(k * h, r.n_prompt),
                    "n_kept": np.full(k * h, r.n_kept),
                },
                schema_overrides={"doc_id": pl.String},
            ).cast(TRAJECTORY_SCHEMA)
        )
    if not frames:
        return pl.DataFrame(schema=TRAJECTORY_SCHEMA)
    return pl.concat(frames)


def rollout_documents_actions(
    model: torch.nn.Module,
    tokenizer: Any,
    documents: Iterable[tuple[str, str, Mapping[str, int]]],
    actions: Sequence[ActionSpec | Mapping[str, Any]],
    H: int,
    seed: int,
    eos_ids: Sequence[int],
    coupling: str = "shared-reference",
    max_batch_rows: int = 192,
    progress: Any = None,
    timing: dict[str, dict[str, float]] | None = None,
) -> dict[str, pl.DataFrame]:
    """Coupled rollouts of many documents under several actions: one §3.2 table per action.

    ``documents``: ``(doc_id, prompt, {action name: K})``; an action absent from a document's
    mapping does not run it. Each prompt is wrapped by the tokenizer's chat template (SPEC §5)
    and prefilled once for all its actions (:func:`rollout_document_actions`). Each action's
    table lists its documents in the order given. ``progress``: optional tqdm-like object
    updated once per document. ``timing``: optional dict filled with, per action name, the
    sums over its documents of ``documents``, ``paths`` and the seconds of
    :func:`rollout_document_actions` (``prefill_seconds``: each document's shared prefill,
    counted in full for every action that runs it; ``selection_seconds``; ``decode_seconds``).
    """
    from kvdiverge.models import chat_prompt_ids

    specs = [a if isinstance(a, ActionSpec) else parse_action(a) for a in actions]
    rollouts: dict[str, list[DocumentRollout]] = {a.name: [] for a in specs}
    rows = max_batch_rows
    for doc_id, prompt, counts in documents:
        unknown = [name for name in counts if name not in rollouts]
        if unknown:
            raise ValueError(f"document {doc_id}: replicates for unknown action(s) {unknown}")
        running = [a for a in specs if a.name in counts]
        if running:
            ids = chat_prompt_ids(tokenizer, prompt)
            results = rollout_document_actions(
                model, ids, running, doc_id, counts, H, seed, eos_ids, coupling, rows
            )
            for name, result in results.items():
                per = result.rows_per_replicate
                if result.batch_rows < min(max(1, rows // per), len(result.replicates)) * per:
                    rows = result.batch_rows  # an out-of-memory split: keep the size that fitted
                rollouts[name].append(result)
                if timing is not None:
                    sums = timing.setdefault(name, dict.fromkeys(TIMING_KEYS, 0))
                    sums["documents"] += 1
                    sums["paths"] += len(result.replicates)
                    sums["prefill_seconds"] += result.prefill_seconds
                    sums["selection_seconds"] += result.selection_seconds
                    sums["decode_seconds"] += result.decode_seconds
        if progress is not None:
            progress.update(1)
    return {name: trajectory_frame(results) for name, results in rollouts.items()}


def rollout_documents(
    model: torch.nn.Module,
    tokenizer: Any,
    documents: Iterable[tuple[str, str, int]],
    action: ActionSpec | Mapping[str, Any],
    H: int,
    seed: int,
    eos_ids: Sequence[int],
    coupling: str = "shared-reference",
    max_batch_rows: int = 192,
    progress: Any = None,
) -> pl.DataFrame:
    """Coupled rollouts of many documents ``(doc_id, prompt, K)`` under one action (§3.2 table).

    :func:`rollout_documents_actions` with a single action.
    """
    spec = action if isinstance(action, ActionSpec) else parse_action(action)
    docs = [(doc_id, prompt, {spec.name: k}) for doc_id, prompt, k in documents]
    return rollout_documents_actions(
        model, tokenizer, docs, [spec], H, seed, eos_ids, coupling, max_batch_rows, progress
    )[spec.name]


DOCUMENT_COLUMNS = ("doc_id", "cohort", "prompt")


def select_documents(
    path: str | os.PathLike, cohorts: Mapping[str, int]
) -> list[tuple[str, str, int]]:
    """``(doc_id, prompt, K)`` for the documents of ``path`` (DESIGN §3.1) in ``cohorts``.

    ``cohorts`` maps a cohort name to its replicate count (e.g. ``{dev: K_dev, study1: K}``).
    Sorted by cohort order, then doc_id. A missing column is one clear error naming the file.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
    except (OSError, pa.ArrowInvalid) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{path}: not a readable documents Parquet file ({reason})") from exc
    missing = [c for c in DOCUMENT_COLUMNS if c not in names]
    if missing:
        raise ValueError(f"{path}: documents table lacks column(s) {', '.join(missing)}")
    frame = pl.read_parquet(path, columns=list(DOCUMENT_COLUMNS))
    if frame["doc_id"].n_unique() != frame.height:
        raise ValueError(f"{path}: doc_id values are not unique")
    out = []
    for cohort, k in cohorts.items():
        rows = frame.filter(pl.col("cohort") == cohort).sort("doc_id")
        out.extend((d, p, int(k)) for d, p in zip(rows["doc_id"], rows["prompt"], strict=True))
    return out


def select_job_documents(
    path: str | os.PathLike, cohorts: Mapping[str, Mapping[str, int]]
) -> list[tuple[str, str, dict[str, int]]]:
    """``(doc_id, prompt, {action: K})`` for a job of several actions (DESIGN §3.1, §4).

    ``cohorts[action]`` maps cohort → K as in :func:`select_documents`. Documents come in the
    order of the first action that runs them (each action's own order is the same when the
    actions list the same cohorts, as a study's do).
    """
    order: dict[str, tuple[str, dict[str, int]]] = {}
    for action, per_cohort in cohorts.items():
        for doc_id, prompt, k in select_documents(path, per_cohort):
            order.setdefault(doc_id, (prompt, {}))[1][action] = k
    return [(doc_id, prompt, counts) for doc_id, (prompt, counts) in order.items()]


def _load(model: Mapping[str, Any], device: str) -> tuple[torch.nn.Module, Any]:
    from kvdiverge.models import load_model, load_tokenizer

    trust = bool(model.get("trust_remote_code", False))
    lm = load_model(
        model["path"],
        device=device,
        dtype=model.get("dtype", "auto"),
        revision=model.get("revision"),
        trust_remote_code=trust,
    )
    tokenizer = load_tokenizer(
        model["path"], trust_remote_code=trust, revision=model.get("revision")
    )
    return lm, tokenizer


def run_stratum_rollout_job(
    documents_path: str | os.PathLike,
    out_paths: Mapping[str, str | os.PathLike],
    model: Mapping[str, Any],
    actions: Mapping[str, Mapping[str, Any]],
    cohorts: Mapping[str, Mapping[str, int]],
    H: int,
    seed: int,
    coupling: str = "shared-reference",
    max_batch_rows: int = 192,
    device: str = "auto",
    log_file: Any = None,
) -> dict[str, pl.DataFrame]:
    """One rollout job of the pipeline (DESIGN §2): a stratum's documents under every action
    of a study → one trajectory file per action (§3.2).

    The model loads once and each document is prefilled once for all actions
    (:func:`rollout_documents_actions`); every file equals the one :func:`run_rollout_job`
    writes for that action alone up to floating-point rounding of δ and f. ``out_paths``,
    ``actions`` (spec dicts) and ``cohorts`` (cohort → K) are keyed by action name. Inputs are
    checked before the model loads; progress (one tick per document) goes to ``log_file``.
    Each file's metadata key ``timing`` holds the action's measured seconds
    (``rollout_documents_actions``'s ``timing``; SPEC §5 sample-size planning reads them): the
    only part of a file that differs between reruns.
    """
    from tqdm import tqdm

    from kvdiverge.models import eos_token_ids
    from kvdiverge.trajectories import write_trajectories

    if coupling not in COUPLING_MODES:
        raise ValueError(f"coupling: expected one of {', '.join(COUPLING_MODES)}, got {coupling!r}")
    for name, spec in actions.items():
        if spec.get("name", name) != name:
            raise ValueError(f"actions.{name}: the spec is named {spec['name']!r}")
    specs = {name: parse_action(spec, name=name) for name, spec in actions.items()}
    for field, given in (("out_paths", out_paths), ("cohorts", cohorts)):
        if set(given) != set(specs):
            raise ValueError(
                f"{field}: expected one entry per action ({', '.join(specs)}), "
                f"got {', '.join(given) or 'none'}"
            )
    documents = select_job_documents(documents_path, {name: cohorts[name] for name in specs})
    if not documents:
        log.warning("%s: no documents of the job's cohorts", documents_path)
    lm, tokenizer = _load(model, device)
    eos = eos_token_ids(lm, tokenizer)
    log.info(
        "model %s (%s, %s on %s); actions %s; %d documents; H=%d; EOS %s",
        model.get("name", model["path"]),
        model["path"],
        lm.dtype,
        lm.device,
        ", ".join(s.name for s in specs.values()),
        len(documents),
        H,
        eos,
    )
    timing: dict[str, dict[str, float]] = {}
    with tqdm(total=len(documents), file=log_file, unit="doc", mininterval=1.0) as bar:
        frames = rollout_documents_actions(
            lm,
            tokenizer,
            documents,
            list(specs.values()),
            H,
            seed,
            eos,
            coupling,
            max_batch_rows,
            progress=bar,
            timing=timing,
        )
    out = {}
    for name, spec in specs.items():
        frame = frames[spec.name]
        metadata = {
            "model": {"name": model.get("name"), "path": str(model["path"])},
            "revision": model.get("revision"),
            "action": spec.as_dict(),
            "H": H,
            "K": dict(cohorts[name]),
            "seed": seed,
            "coupling": coupling,
            "dtype": str(lm.dtype).removeprefix("torch."),
            "device": str(lm.device),
            "eos_ids": list(eos),
            "n_documents": frame["doc_id"].n_unique(),
            "timing": timing.get(spec.name, dict.fromkeys(TIMING_KEYS, 0)),
        }
        write_trajectories(frame, out_paths[name], metadata)
        out[name] = frame
    return out


def run_rollout_job(
    documents_path: str | os.PathLike,
    out_path: str | os.PathLike,
    model: Mapping[str, Any],
    action: Mapping[str, Any],
    cohorts: Mapping[str, int],
    H: int,
    seed: int,
    coupling: str = "shared-reference",
    max_batch_rows: int = 192,
    device: str = "auto",
    log_file: Any = None,
) -> pl.DataFrame:
    """A rollout job of one action (DESIGN §2): documents → one trajectory file (§3.2).

    ``model``: ``{name, path, revision, trust_remote_code, dtype}``; ``action``: an action
    spec dict with its name; ``cohorts``: replicates per cohort. The single-action case of
    :func:`run_stratum_rollout_job`.
    """
    name = parse_action(action).name
    return run_stratum_rollout_job(
        documents_path,
        {name: out_path},
        model,
        {name: action},
        {name: cohorts},
        H,
        seed,
        coupling,
        max_batch_rows,
        device,
        log_file,
    )[name]
