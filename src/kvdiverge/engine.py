"""The coupled rollout engine: batched stepwise maximal coupling with a shared prompt cache.

Implements SPEC §1, §5 (rollouts), §6 (common random numbers) with the architecture of
DESIGN §4:

* one prefill per document gives the full prompt cache and the first-token logits (shared by
  the reference P and the intervention Q, so δ_1 = 0);
* the action's selector gathers its kept entries from that cache once per document;
* all replicates and all three streams of a document decode as one batch: rows
  ``[X₀…X_{K−1} | Y₀…Y_{K−1} | Z₀…Z_{K−1}]`` — the reference X on the full prompt cache, the
  intervention Y and the fixed-history stream Z (Q fed X's tokens, for f_t) on the evicted one;
* the prompt cache is shared by every row, never copied per replicate: a custom attention
  function (registered with transformers' ``AttentionInterface``) scores each stream's queries
  against its shared prompt part in one batched product (grouped-query heads folded), scores
  each row's own generated entries (a cache that holds only those) separately, and merges the
  two exactly with a common max (log-sum-exp). Memory is O(prompt + K·H);
* the stepwise maximal coupling (``kvdiverge.coupling.maximal_coupling_step``, accept sampler)
  runs every step with common random numbers: X by inverse CDF from the REFERENCE stream, keyed
  by (seed, document, replicate, t) only, so X is identical across actions; ACCEPT and RESIDUAL
  streams for Y. ``coupling="independent"`` salts all streams with the action name;
* temperature 1, full softmax (float64), EOS absorbing (after EOS a sequence's kernel is the
  point mass on the canonical EOS id, the first of ``eos_ids``); H steps always;
* on CUDA out-of-memory the replicate batch is split in halves and the rollout goes on.

Each stream's prompt part is scored in its own product of identical shape, so the X rows'
arithmetic does not depend on the action (identical X across actions, bit for bit) and the
``full`` action reproduces the reference exactly (δ ≡ 0, f ≡ 0, X ≡ Y). Z rows are always
computed (before divergence they equal Y): a fixed batch layout keeps those guarantees.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvdiverge.coupling import Stream, crn_uniforms, document_key, maximal_coupling_step, tv
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
    "rollout_document",
    "rollout_documents",
    "run_rollout_job",
    "select_documents",
    "shared_prefix_attention",
    "trajectory_frame",
]

log = logging.getLogger(__name__)

ATTENTION_NAME = "kvdiverge_shared_prefix"
COUPLING_MODES = ("shared-reference", "independent")


@dataclass
class SharedPrefix:
    """The shared prompt K/V of every row group, per layer (passed as a model-call kwarg).

    ``groups[l]`` is a list of ``(row_start, row_end, keys, values)`` with keys/values of shape
    (H_kv, n_g, d): rows ``row_start:row_end`` of the batch attend to that prompt part.
    ``mirror = (group_start, source_start, active)``: in the group starting at ``group_start``
    only the rows ``active`` (offsets in the group) are computed; the others equal the rows of
    the group starting at ``source_start`` (listed earlier) and are copied. The engine uses it
    for the Z stream, which equals Y until a replicate's histories split (DESIGN §4).
    """

    groups: list[list[tuple[int, int, torch.Tensor, torch.Tensor]]]
    mirror: tuple[int, int, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        self._rows: dict[tuple[int, int], torch.Tensor] = {}

    def rows(self, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """Row indices ``start..stop-1`` (cached: built once per rollout, not per layer)."""
        key = (start, stop)
        if key not in self._rows:
            self._rows[key] = torch.arange(start, stop, device=device)
        return self._rows[key]


class RowCache:
    """Decode cache holding only each row's own generated entries (DESIGN §4).

    Preallocated (B, H_kv, capacity, d) per layer; ``update`` appends the step's entries and
    returns the filled part. Every row advances one entry per step.
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

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, H_kv, q, d) entries for layer ``layer_idx``; return all of that layer's."""
        start = self.lengths[layer_idx]
        stop = start + key_states.shape[-2]
        self.keys[layer_idx][:, :, start:stop] = key_states
        self.values[layer_idx][:, :, start:stop] = value_states
        self.lengths[layer_idx] = stop
        return self.keys[layer_idx][:, :, :stop], self.values[layer_idx][:, :, :stop]

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

    On CPU this is PyTorch's fused flash-attention kernel (which returns the log-sum-exp);
    elsewhere, or if that private op is unavailable, the plain matmul–softmax path.
    """
    if q.device.type == "cpu" and _FLASH_CPU[0]:
        try:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, attn_mask=None, scale=scale
            )
            return out.float(), lse.float()
        except (RuntimeError, AttributeError, TypeError):  # pragma: no cover - torch-dependent
            _FLASH_CPU[0] = False
    return _math_attention(q, k, v, scale)


_FLASH_CPU = [hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")]


def shared_prefix_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over (shared prompt part) ∪ (each row's own generated part), merged exactly.

    ``query`` (B, H, q, d); ``key``/``value`` (B, H_kv, t, d) are the rows' own entries (from
    :class:`RowCache`, the current one included). The shared prompt parts arrive as the
    ``kvd_prefix`` kwarg (:class:`SharedPrefix`). Without it this is plain SDPA attention.
    Each part gives a normalised output and its log-sum-exp; the exact softmax over the union
    is their mix with weight sigmoid(lse_prompt − lse_own) (log-sum-exp merge, DESIGN §4).
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
    for start, stop, pk, pv in prefix.groups[module.layer_idx]:
        rows = prefix.rows(start, stop, q.device)
        if prefix.mirror is not None and prefix.mirror[0] == start:
            source, active = prefix.mirror[1], prefix.mirror[2]
            o_pre[start:stop] = o_pre[source : source + stop - start]
            lse_pre[start:stop] = lse_pre[source : source + stop - start]
            rows = start + active
            if rows.numel() == 0:
                continue
        n_rows = rows.numel()
        qg = q[rows].permute(1, 0, 2, 3).reshape(1, n_kv, n_rows * groups, d)
        o, lse = _attention_with_lse(qg, pk[None], pv[None], scale)
        o_pre[rows] = o.reshape(n_kv, n_rows, groups, d).permute(1, 0, 2, 3)
        lse_pre[rows] = lse.reshape(n_kv, n_rows, groups).permute(1, 0, 2)
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
    batch_rows: int = 0
    logits: dict[str, np.ndarray] | None = None


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


@torch.no_grad()
def _rollout_chunk(
    model: torch.nn.Module,
    prefill: Prefill,
    prefix_full: list[tuple[torch.Tensor, torch.Tensor]],
    prefix_kept: list[tuple[torch.Tensor, torch.Tensor]],
    replicates: np.ndarray,
    doc_key: int,
    H: int,
    seed: int,
    eos_ids: Sequence[int],
    salt: int,
    keep_logits: bool,
    identity: bool = False,
) -> dict[str, np.ndarray]:
    device = prefill.last_logits.device
    k = len(replicates)
    n = prefill.n
    n_layers = len(prefill.keys)
    n_kv, _, d = prefill.keys[0].shape
    groups = [
        [
            (0, k, *prefix_full[layer]),
            (k, 2 * k, *prefix_kept[layer]),
            (2 * k, 3 * k, *prefix_kept[layer]),
        ]
        for layer in range(n_layers)
    ]
    shared = SharedPrefix(groups)
    cache = RowCache(n_layers, 3 * k, n_kv, d, max(H - 1, 1), prefill.keys[0].dtype, device)
    eos = torch.tensor(list(eos_ids), device=device)
    canonical = int(eos_ids[0])
    vocab = prefill.last_logits.shape[-1]
    point_mass = torch.zeros(vocab, dtype=torch.float64, device=device)
    point_mass[canonical] = 1.0

    out = {
        name: torch.empty((k, H), dtype=dtype, device=device)
        for name, dtype in (
            ("x_token", torch.long),
            ("y_token", torch.long),
            ("tv_rollout", torch.float64),
            ("tv_fixed", torch.float64),
            ("x_eos", torch.bool),
            ("y_eos", torch.bool),
        )
    }
    kept_logits: dict[str, list[torch.Tensor]] = {"p": [], "q": [], "q_fixed": []}
    uniforms = _uniforms(seed, doc_key, replicates, H, salt, device)
    x_done = torch.zeros(k, dtype=torch.bool, device=device)
    split = torch.zeros(k, dtype=torch.bool, device=device)  # X_{≤t} ≠ Y_{≤t}
    no_rows = torch.zeros(0, dtype=torch.long, device=device)
    y_done = torch.zeros(k, dtype=torch.bool, device=device)
    logits = prefill.last_logits.float().expand(3 * k, vocab)
    with _attention_implementation(model, ATTENTION_NAME):
        for t in range(1, H + 1):
            probs = logits.double().softmax(dim=-1)
            p, q, q_fixed = probs[:k], probs[k : 2 * k], probs[2 * k :]
            if identity:  # nothing evicted: Q is P as a kernel (the rows still run, same shapes)
                q = q_fixed = p
            if keep_logits:
                for name, part in zip(kept_logits, logits.float().split(k), strict=True):
                    kept_logits[name].append(part.cpu())
            p = torch.where(x_done[:, None], point_mass, p)
            q = torch.where(y_done[:, None], point_mass, q)
            q_fixed = torch.where(x_done[:, None], point_mass, q_fixed)
            x, y = maximal_coupling_step(p, q, uniforms[t - 1])
            x_done = x_done | torch.isin(x, eos)
            y_done = y_done | torch.isin(y, eos)
            out["x_token"][:, t - 1] = x
            out["y_token"][:, t - 1] = y
            out["tv_rollout"][:, t - 1] = tv(p, q)
            out["tv_fixed"][:, t - 1] = tv(p, q_fixed)
            out["x_eos"][:, t - 1] = x_done
            out["y_eos"][:, t - 1] = y_done
            if t == H:
                break
            split = split | (x != y)
            # Z's prompt attention equals Y's until the histories split: compute split rows only
            active = split.nonzero()[:, 0] if not identity else no_rows
            shared.mirror = (2 * k, k, active)
            tokens = torch.cat([x, y, x])[:, None]
            position = torch.full((3 * k, 1), n + t - 1, dtype=torch.long, device=device)
            result = model(
                input_ids=tokens,
                position_ids=position,
                cache_position=torch.tensor([t - 1], device=device),
                past_key_values=cache,
                use_cache=True,
                kvd_prefix=shared,
            )
            logits = result.logits[:, -1]
    arrays = {name: v.cpu().numpy() for name, v in out.items()}
    if keep_logits:
        for name, parts in kept_logits.items():
            arrays[f"logits_{name}"] = torch.stack(parts, dim=1).numpy()
    return arrays


def _rollout_replicates(replicates: np.ndarray, run: Any, max_rows: int) -> tuple[list[dict], int]:
    """Run ``run`` on chunks of at most ``max_rows // 3`` replicates; halve a chunk on OOM.

    Returns the results in replicate order and the largest chunk size that ran.
    """
    chunk = max(1, max_rows // 3)
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


def _gather_prefix(prefill: Prefill, kept: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for layer, (keys, values) in enumerate(zip(prefill.keys, prefill.values, strict=True)):
        index = kept[layer][..., None].expand(-1, -1, keys.shape[-1])
        out.append((keys.gather(1, index), values.gather(1, index)))
    return out


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
    exact_identity: bool = True,
) -> DocumentRollout:
    """Coupled rollouts of one document under one action (SPEC §1, §6; DESIGN §4).

    ``input_ids``: the chat-wrapped prompt (:func:`kvdiverge.models.chat_prompt_ids`);
    ``replicates``: K or explicit replicate indices (each keyed into the random streams);
    ``eos_ids``: EOS token ids, the first one canonical. ``keep_logits`` also returns the
    per-step logits of P (X rows), Q (Y rows) and Q on X's history (Z rows), for tests.
    A ``prefill`` computed with :func:`kvdiverge.eviction.run_prefill` may be reused.

    When the action keeps every prompt entry (``full``, or a budget ≥ n) the intervention
    kernel is the reference kernel: with ``exact_identity`` (default) Q and the fixed-history Q
    are set to P itself, so δ ≡ f ≡ 0 and Y ≡ X exactly (the Y and Z rows still run, keeping the
    batch layout, hence X, identical to other actions'). ``exact_identity=False`` uses the Y/Z
    rows' own logits, which agree with P to floating-point accuracy (CPU vector kernels may
    round rows at different batch positions differently).
    """
    if coupling not in COUPLING_MODES:
        raise ValueError(f"coupling: expected one of {', '.join(COUPLING_MODES)}, got {coupling!r}")
    if H < 1:
        raise ValueError(f"H: expected an integer >= 1, got {H}")
    if not eos_ids:
        raise ValueError("eos_ids: at least one EOS token id is needed")
    action = action if isinstance(action, ActionSpec) else parse_action(action)
    reps = np.arange(replicates) if isinstance(replicates, int) else np.asarray(replicates)
    reps = reps.astype(np.int64)
    if prefill is None:
        window = SELECTORS[action.selector].query_window(action)
        prefill = run_prefill(model, input_ids, window)
    _check_model(model, prefill.n, H)
    kept = select_positions(prefill, action)
    identity = exact_identity and kept.shape[-1] == prefill.n
    prefix_full = list(zip(prefill.keys, prefill.values, strict=True))
    prefix_kept = _gather_prefix(prefill, kept)
    doc_key = document_key(doc_id)
    salt = 0 if coupling == "shared-reference" else document_key(f"action:{action.name}")

    def run(part: np.ndarray) -> dict[str, np.ndarray]:
        return _rollout_chunk(
            model,
            prefill,
            prefix_full,
            prefix_kept,
            part,
            doc_key,
            H,
            seed,
            eos_ids,
            salt,
            keep_logits,
            identity,
        )

    parts, fitted = _rollout_replicates(reps, run, max_batch_rows)
    merged = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    logits = {k[len("logits_") :]: v for k, v in merged.items() if k.startswith("logits_")}
    return DocumentRollout(
        doc_id=doc_id,
        replicates=reps,
        x_token=merged["x_token"],
        y_token=merged["y_token"],
        tv_rollout=merged["tv_rollout"],
        tv_fixed=merged["tv_fixed"],
        x_eos=merged["x_eos"],
        y_eos=merged["y_eos"],
        n_prompt=prefill.n,
        n_kept=int(kept.shape[-1]),
        batch_rows=3 * fitted,
        logits=logits or None,
    )


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
    """Coupled rollouts of many documents ``(doc_id, prompt, K)``: the §3.2 trajectory table.

    Each prompt is wrapped by the tokenizer's chat template (SPEC §5). ``progress`` is an
    optional tqdm-like object updated once per document.
    """
    from kvdiverge.models import chat_prompt_ids

    action = action if isinstance(action, ActionSpec) else parse_action(action)
    rollouts = []
    rows = max_batch_rows
    for doc_id, prompt, k in documents:
        ids = chat_prompt_ids(tokenizer, prompt)
        result = rollout_document(model, ids, action, doc_id, k, H, seed, eos_ids, coupling, rows)
        if result.batch_rows < min(rows, 3 * k):
            rows = result.batch_rows  # an out-of-memory split: keep the size that fitted
        rollouts.append(result)
        if progress is not None:
            progress.update(1)
    return trajectory_frame(rollouts)


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
    """One rollout job of the pipeline (DESIGN §2): documents → trajectory file (§3.2).

    ``model``: ``{name, path, revision, trust_remote_code, dtype}``; ``action``: an action
    spec dict with its name; ``cohorts``: replicates per cohort. Inputs are checked before the
    model loads; progress (one tick per document) goes to ``log_file``.
    """
    from tqdm import tqdm

    from kvdiverge.models import eos_token_ids, load_model, load_tokenizer
    from kvdiverge.trajectories import write_trajectories

    spec = parse_action(action)
    if coupling not in COUPLING_MODES:
        raise ValueError(f"coupling: expected one of {', '.join(COUPLING_MODES)}, got {coupling!r}")
    documents = select_documents(documents_path, cohorts)
    if not documents:
        log.warning("%s: no documents of cohort(s) %s", documents_path, ", ".join(cohorts))
    lm = load_model(
        model["path"],
        device=device,
        dtype=model.get("dtype", "auto"),
        revision=model.get("revision"),
        trust_remote_code=bool(model.get("trust_remote_code", False)),
    )
    tokenizer = load_tokenizer(
        model["path"],
        trust_remote_code=bool(model.get("trust_remote_code", False)),
        revision=model.get("revision"),
    )
    eos = eos_token_ids(lm, tokenizer)
    log.info(
        "model %s (%s, %s on %s); action %s; %d documents; H=%d; EOS %s",
        model.get("name", model["path"]),
        model["path"],
        lm.dtype,
        lm.device,
        spec.name,
        len(documents),
        H,
        eos,
    )
    with tqdm(total=len(documents), file=log_file, unit="doc", mininterval=1.0) as bar:
        frame = rollout_documents(
            lm, tokenizer, documents, spec, H, seed, eos, coupling, max_batch_rows, progress=bar
        )
    metadata = {
        "model": {"name": model.get("name"), "path": str(model["path"])},
        "revision": model.get("revision"),
        "action": spec.as_dict(),
        "H": H,
        "K": dict(cohorts),
        "seed": seed,
        "coupling": coupling,
        "dtype": str(lm.dtype).removeprefix("torch."),
        "device": str(lm.device),
        "eos_ids": list(eos),
        "n_documents": len(documents),
    }
    write_trajectories(frame, out_path, metadata)
    return frame
