"""The coupled decode loop: one document's rollouts under several actions, one model call a step.

``docs/method.md`` states the coupling; ``docs/architecture.md`` ("Coupled decoding") the batch:

* one prefill per document gives the full prompt cache and the first-token logits (shared by
  the reference P and every intervention Q, so δ_1 = 0), whatever the number of actions;
* each action's selector gathers its kept entries from that cache once per document;
* all replicates and streams of a document decode as ONE batch, one model call per step:
  the reference rows X on the full prompt cache, then for each action its intervention rows Y
  on its evicted cache, then the fixed-history rows Z (Q fed X's tokens, for f_t) of the
  replicates whose histories have split. The X rows are shared by every action with the same
  replicates (:func:`reference_groups`), so each step reads the model's weights once for all;
* the prompt caches are shared by their rows, never copied per replicate
  (:mod:`kvdiverge.attention`). Memory is O(prompt + K·H) per action;
* the stepwise maximal coupling (:func:`kvdiverge.coupling.maximal_coupling_step`, accept
  sampler) runs every step with common random numbers: X by inverse CDF from the REFERENCE
  stream keyed by (seed, document, replicate, t) only, so X is identical across actions; ACCEPT
  and RESIDUAL streams for Y. ``coupling="independent"`` salts all streams with the action name
  (each action then has its own X rows);
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
shared-prefix attention and the coupling and can fail (on CPU float32 with one thread it gives
δ ≡ f ≡ 0 and X ≡ Y exactly). ``identity_shortcut=True`` (for benchmarks only) skips those rows
and sets Q := P. Reruns are bit-identical. An action run with others shares its model calls
with their rows, so its values equal a run of that action alone to floating-point rounding (the
matrix products' batch differs), not bit for bit; the tokens differ only where a uniform falls
within rounding of a CDF boundary. A replicate's Z row runs only after its X and Y histories
split: until then Z is Y (the same tokens on the same cache), so its Q is Y's, copied bit for
bit, and at the split the Z row starts from a copy of Y's generated entries. Before divergence
an action therefore costs one row per replicate, not two.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvdiverge.attention import (
    ATTENTION_NAME,
    RowCache,
    SharedPrefix,
    attention_implementation,
)
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
    ActionSpec,
    Prefill,
    kept_counts,
    parse_action,
    run_prefill,
    select_positions,
)

__all__ = [
    "COUPLING_MODES",
    "DocumentRollout",
    "RolloutSettings",
    "reference_groups",
    "rollout_document",
    "rollout_document_actions",
]

log = logging.getLogger(__name__)

COUPLING_MODES = ("shared-reference", "independent")


@dataclass(frozen=True)
class RolloutSettings:
    """The settings that travel together through every rollout entry point.

    ``H``: steps per rollout; ``seed``: master seed of the common random numbers; ``coupling``:
    ``shared-reference`` (one X per replicate set, shared by the actions) or ``independent``;
    ``max_batch_rows``: rows a model call may hold (a replicate costs X, and Y and at most Z
    per evicting action); ``keep_logits``: also return every row's logits (tests; keeps ended
    rows); ``identity_shortcut``: Q := P for an action that keeps everything, without rows of
    its own (benchmarks only: the control then cannot fail); ``drop_ended``: rows whose
    stream has ended leave the batch; ``fused_attention``: use a validated fused attention
    kernel where one exists.
    """

    H: int
    seed: int
    coupling: str = "shared-reference"
    max_batch_rows: int = 192
    keep_logits: bool = False
    identity_shortcut: bool = False
    drop_ended: bool = True
    fused_attention: bool = True

    def __post_init__(self) -> None:
        if self.coupling not in COUPLING_MODES:
            raise ValueError(
                f"coupling: expected one of {', '.join(COUPLING_MODES)}, got {self.coupling!r}"
            )
        if not isinstance(self.H, int | np.integer) or self.H < 1:
            raise ValueError(f"H: expected an integer >= 1, got {self.H}")
        if self.max_batch_rows < 1:
            raise ValueError(f"max_batch_rows: expected an integer >= 1, got {self.max_batch_rows}")


@dataclass
class DocumentRollout:
    """One document's coupled rollouts, arrays of shape (K, H) (logits: (K, H, V))."""

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


def _check_model(model: torch.nn.Module, n: int, H: int) -> None:
    for layer in model.model.layers:
        window = getattr(layer.self_attn, "sliding_window", None)
        if window is not None and window < n + H:
            raise ValueError(
                f"model: layer uses sliding-window attention ({window} < {n + H} positions); "
                "the engine needs full attention"
            )


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

    Streams REFERENCE, ACCEPT, RESIDUAL, keyed by (seed, document, replicate, t).
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

    prefix: list[tuple[torch.Tensor, ...]] | None


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


def _absorbed(kernel: torch.Tensor, done: torch.Tensor, point_mass: torch.Tensor) -> torch.Tensor:
    """The kernel with the point mass on EOS in the rows that have emitted EOS."""
    return torch.where(done[:, None], point_mass, kernel) if bool(done.any()) else kernel


class _RowBatch:
    """The rows of one decoding chunk and the prompt part each attends to.

    Streams: 0 is X; for the j-th evicting intervention, ``y(j) = 1 + 2j`` is its Y stream and
    ``y(j) + 1`` its Z stream. ``stream`` and ``replicate`` give each batch row's stream and
    replicate (X and Y rows first, Z rows appended as histories split); row group 0 (X) attends
    to the full prompt, group 1 + j (Y and Z of intervention j) to its evicted prompt.
    """

    def __init__(
        self,
        prompts: list[list[tuple[torch.Tensor, torch.Tensor]]],
        k: int,
        cache: RowCache,
        fused: bool,
    ) -> None:
        device = cache.keys[0].device
        self.prompts, self.k, self.cache, self.fused = prompts, k, cache, fused
        self.n_streams = 2 * len(prompts) - 1
        self.reps = torch.arange(k, device=device)
        group = torch.arange(len(prompts), device=device).repeat_interleave(k)
        self.stream = torch.where(group > 0, 2 * group - 1, 0)
        self.replicate = self.reps.repeat(len(prompts))
        cache.rows = self.stream.numel()
        self._layout()

    @staticmethod
    def y(j: int) -> int:
        """Stream code of the j-th evicting intervention's Y rows (its Z rows: ``y(j) + 1``)."""
        return 1 + 2 * j

    def _layout(self) -> None:
        members = [(self.stream == s).nonzero()[:, 0] for s in range(self.n_streams)]
        self.members = [(rows, self.replicate[rows]) for rows in members]
        group = (self.stream + 1) // 2  # X → prompt 0, Y and Z of evicted[j] → prompt 1 + j
        rows = [(group == g).nonzero()[:, 0] for g in range(len(self.prompts))]
        self.shared = SharedPrefix(rows, self.prompts, self.fused)

    def by_replicate(
        self, values: torch.Tensor, code: int, base: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Stream ``code``'s (k, V) rows of ``values`` by replicate, from ``base`` where it has
        no row (an ended row, or a Z not yet split), else zeros (a point mass replaces them)."""
        batch_rows, row_reps = self.members[code]
        k = self.k
        if base is None and batch_rows.numel() == k and bool((row_reps == self.reps).all()):
            return values.index_select(0, batch_rows)
        start = values.new_zeros((k, values.shape[-1]))
        return (start if base is None else base).index_copy(
            0, row_reps, values.index_select(0, batch_rows)
        )

    def start_z_rows(self, j: int, new: torch.Tensor) -> None:
        """Z rows of intervention j for replicates ``new``, from copies of their Y rows."""
        y_rows, y_reps = self.members[self.y(j)]
        source = torch.full((self.k,), -1, dtype=torch.long, device=new.device)
        source[y_reps] = y_rows
        cache = self.cache
        slots = torch.arange(cache.rows, cache.rows + new.numel(), device=new.device)
        cache.copy_rows(source[new], slots)
        cache.rows += new.numel()
        self.stream = torch.cat([self.stream, torch.full_like(new, self.y(j) + 1)])
        self.replicate = torch.cat([self.replicate, new])

    def ended(self, x_done: torch.Tensor, y_done: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per batch row: whether its stream has ended (X and Z after X's EOS, Y after Y's)."""
        per_stream = torch.stack([x_done] + [e for done in y_done for e in (done, x_done)])
        return per_stream[self.stream, self.replicate]

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (their cache entries move to the front)."""
        self.cache.keep_rows(rows)
        self.stream, self.replicate = self.stream[rows], self.replicate[rows]

    def relayout(self) -> None:
        self._layout()

    def tokens(self, x: torch.Tensor, y: Sequence[torch.Tensor]) -> torch.Tensor:
        """Each batch row's next input: X's token for X and Z rows, Y's for Y rows."""
        per_stream = torch.stack([x] + [s for y_j in y for s in (y_j, x)])
        return per_stream[self.stream, self.replicate]


@torch.inference_mode()
def _rollout_chunk(
    model: torch.nn.Module,
    prefill: Prefill,
    prefix_full: list[tuple[torch.Tensor, torch.Tensor]],
    interventions: Sequence[_Intervention],
    replicates: np.ndarray,
    doc_key: int,
    eos_ids: Sequence[int],
    salt: int,
    settings: RolloutSettings,
) -> list[dict[str, np.ndarray]]:
    """Coupled rollouts of ``replicates`` under every intervention, sharing one X stream.

    Each step runs ONE model call for all running rows: the k reference rows X (full prompt
    cache), each evicted intervention's k Y rows, and the Z rows (Q fed X's tokens, for f_t;
    on the intervention's evicted cache) of the (intervention, replicate) pairs whose X and Y
    histories have split, added in the order they split. Before its split a replicate's Z is Y
    itself (the same cache, the same tokens), so Q on X's history is Y's Q, bit for bit, and no
    row runs for it; at the split the Z row starts from a copy of the Y row's generated
    entries. An intervention with ``prefix=None`` (the identity shortcut) has Q := P itself
    (δ ≡ f ≡ 0, Y ≡ X) and runs no rows.

    A row whose stream has ended no longer matters: an X row once X emitted EOS, a Y row once
    Y did, a Z row once X did (from then on the kernel is the point mass on EOS). With
    ``settings.drop_ended`` ended rows leave the batch when they make up a quarter of it (the
    running rows' generated entries are then moved to the front); until then they run and
    their logits are ignored. With ``settings.keep_logits`` every row stays, so that every
    stream's logits are recorded.
    """
    H, keep_logits = settings.H, settings.keep_logits
    device = prefill.last_logits.device
    k = len(replicates)
    n = prefill.n
    n_kv, _, d = prefill.keys[0].shape
    evicted = [i for i, act in enumerate(interventions) if act.prefix is not None]
    y_stream = {i: _RowBatch.y(j) for j, i in enumerate(evicted)}
    cache = RowCache(
        len(prefill.keys),
        k * (1 + 2 * len(evicted)),
        n_kv,
        d,
        max(H - 1, 1),
        prefill.keys[0].dtype,
        device,
    )
    prompts = [list(prefix_full)] + [list(interventions[i].prefix) for i in evicted]
    batch = _RowBatch(prompts, k, cache, settings.fused_attention)
    z_started = {i: torch.zeros(k, dtype=torch.bool, device=device) for i in evicted}
    eos = torch.tensor(sorted({int(e) for e in eos_ids}), device=device)
    first = prefill.last_logits.float()
    vocab = first.shape[-1]
    point_mass = torch.zeros(vocab, dtype=torch.float64, device=device)
    point_mass[canonical_eos(eos_ids)] = 1.0

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
    uniforms = _uniforms(settings.seed, doc_key, replicates, H, salt, device)
    x_done = torch.zeros(k, dtype=torch.bool, device=device)
    y_done = [torch.zeros(k, dtype=torch.bool, device=device) for _ in interventions]
    split = [torch.zeros(k, dtype=torch.bool, device=device) for _ in interventions]
    logits = first.expand(cache.rows, vocab)  # this step's logits of every batch row

    with attention_implementation(model, ATTENTION_NAME):
        for t in range(1, H + 1):
            probs = merge_eos(logits.double().softmax(dim=-1), eos_ids, inplace=True)
            p_raw = batch.by_replicate(probs, 0)
            p = _absorbed(p_raw, x_done, point_mass)
            x = None
            for i in range(len(interventions)):
                if i in y_stream:
                    q_raw = batch.by_replicate(probs, y_stream[i])
                    q_fixed_raw = batch.by_replicate(probs, y_stream[i] + 1, base=q_raw)
                else:  # the identity shortcut: Q is P as a kernel
                    q_raw = q_fixed_raw = p_raw
                if keep_logits:
                    lp = batch.by_replicate(logits, 0)
                    lq = batch.by_replicate(logits, y_stream[i]) if i in y_stream else lp
                    lz = (
                        batch.by_replicate(logits, y_stream[i] + 1, base=lq)
                        if i in y_stream
                        else lp
                    )
                    for name, part in zip(("p", "q", "q_fixed"), (lp, lq, lz), strict=True):
                        kept_logits[i][name].append(part.float().cpu())
                q = _absorbed(q_raw, y_done[i], point_mass)
                q_fixed = _absorbed(q_fixed_raw, x_done, point_mass)
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
            for j, i in enumerate(evicted):  # newly split, X running: Z starts from Y's history
                running = ~x_done | keep_logits  # (kept logits: every Z law is recorded)
                new = (split[i] & ~z_started[i] & running).nonzero()[:, 0]
                z_started[i] = split[i].clone()
                if new.numel():
                    batch.start_z_rows(j, new)
                    changed = True
            ended = batch.ended(x_done, [y_done[i] for i in evicted])
            n_ended = int(ended.sum())
            if not keep_logits and settings.drop_ended and n_ended and 4 * n_ended >= ended.numel():
                batch.keep((~ended).nonzero()[:, 0])
                changed = True
            if changed:
                batch.relayout()
            if cache.rows == 0:  # every stream has ended: point masses from here on
                logits = first.new_zeros((0, vocab))
                continue
            tokens = batch.tokens(x, [out[i]["y_token"][:, t - 1] for i in evicted])
            logits = _decode_step(model, tokens, n + t - 1, cache, batch.shared)
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


def _gather_prefix(prefill: Prefill, kept: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's kept entries: (keys, values) of shape (H_kv, n_l, d). Ragged kept sets (−1
    padding, :func:`kvdiverge.eviction.select_positions`) are cut to the layer's longest head;
    where the layer's heads still differ, a third element ``mask`` (H_kv, n_l) marks the real
    entries (:class:`kvdiverge.attention.SharedPrefix`)."""
    out = []
    counts = kept_counts(kept)
    for layer, (keys, values) in enumerate(zip(prefill.keys, prefill.values, strict=True)):
        width = int(counts[layer].max())
        positions = kept[layer][:, :width]
        valid = positions >= 0
        index = positions.clamp_min(0)[..., None].expand(-1, -1, keys.shape[-1])
        part: tuple[torch.Tensor, ...] = (keys.gather(1, index), values.gather(1, index))
        out.append(part if bool(valid.all()) else (*part, valid))
    return out


def _mean_kept(kept: torch.Tensor) -> int:
    """Entries kept per layer and KV head, on average over them (rounded) for ragged sets."""
    counts = kept_counts(kept)
    return int(round(int(counts.sum()) / counts.numel()))


def _replicate_indices(replicates: int | Sequence[int] | np.ndarray) -> np.ndarray:
    reps = np.arange(replicates) if isinstance(replicates, int) else np.asarray(replicates)
    return reps.astype(np.int64)


def reference_groups(
    actions: Sequence[ActionSpec], replicates: Mapping[str, np.ndarray], coupling: str
) -> list[tuple[int, tuple[int, ...], list[int]]]:
    """Actions that share one reference stream X: ``(salt, replicates, action indices)``.

    Under common random numbers X depends only on (seed, document, replicate, t), so
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
    eos_ids: Sequence[int],
    settings: RolloutSettings,
    prefill: Prefill | None = None,
) -> dict[str, DocumentRollout]:
    """Coupled rollouts of one document under several actions (``docs/method.md``).

    ONE prefill serves every action (full cache and first-token logits); each action gathers
    its kept entries from it. Actions with the same replicates share one reference stream X
    (:func:`reference_groups`); each evicting action adds its Y and Z rows. ``replicates``: K
    or explicit indices for every action, or a mapping action name → K or indices (e.g. the
    control's K_control). All rows of a reference group run in one model call per step, so an
    action's result equals :func:`rollout_document` with that action alone to floating-point
    rounding (the batch differs). Returns ``{action name: DocumentRollout}``.

    ``input_ids``: the chat-wrapped prompt (:func:`kvdiverge.models.chat_prompt_ids`);
    ``eos_ids``: EOS token ids, one merged outcome (:func:`kvdiverge.coupling.merge_eos`);
    ``settings``: H, seed, coupling and the options of :class:`RolloutSettings`. With
    ``settings.keep_logits`` the result also holds the per-step logits of P (X rows), Q (Y
    rows) and Q on X's history (Z rows), for tests. A ``prefill`` from
    :func:`kvdiverge.eviction.run_prefill` may be passed in (given these actions, when a
    selector observes the prefill, e.g. kvpress's). ``n_kept`` of a result is the entries kept
    per layer and KV head (their rounded mean for kept sets that vary by layer or head).

    An action that keeps every prompt entry (``full``, or a budget ≥ n) runs like any other:
    its Y/Z rows decode over the gathered full cache, so the full-retention control tests the
    gather, the attention and the coupling. ``settings.identity_shortcut`` (benchmarks only)
    sets Q and the fixed-history Q to P itself instead, so δ ≡ f ≡ 0 and Y ≡ X by
    construction, and no Y/Z rows run.

    Each result also carries wall-clock seconds (``time.perf_counter``, after a CUDA
    synchronize; they change no value): ``prefill_seconds`` of the document's one prefill (the
    same for every action, 0 when ``prefill`` is passed in), the action's own
    ``selection_seconds`` (selection and gather), and ``decode_seconds``: its reference group's
    decode seconds × the row-steps the action would run alone (its running rows': X's, its Y
    rows', its Z rows' after each split; X's only for an exact identity) / the row-steps the
    group ran (the shared X once), i.e. the decode cost of an evaluation run of the action
    alone at the group's cost per row-step.
    """
    if not eos_ids:
        raise ValueError("eos_ids: at least one EOS token id is needed")
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
        start = _clock(device)
        prefill = run_prefill(model, input_ids, actions=specs)
        prefill_seconds = _clock(device) - start
    _check_model(model, prefill.n, settings.H)
    kept: dict[str, torch.Tensor] = {}
    interventions: list[_Intervention] = []
    selection_seconds: dict[str, float] = {}
    for a in specs:  # selection and gather, timed per action
        start = _clock(device)
        kept[a.name] = select_positions(prefill, a)
        identity = settings.identity_shortcut and _mean_kept(kept[a.name]) == prefill.n
        interventions.append(
            _Intervention(None if identity else _gather_prefix(prefill, kept[a.name]))
        )
        selection_seconds[a.name] = _clock(device) - start
    prefix_full = list(zip(prefill.keys, prefill.values, strict=True))
    doc_key = document_key(doc_id)
    results: dict[str, DocumentRollout] = {}
    for salt, group_reps, members in reference_groups(specs, reps, settings.coupling):

        def run(part: np.ndarray, members: list[int] = members, salt: int = salt) -> list[dict]:
            return _rollout_chunk(
                model,
                prefill,
                prefix_full,
                [interventions[i] for i in members],
                part,
                doc_key,
                eos_ids,
                salt,
                settings,
            )

        # batch rows per replicate: X, and each evicting member's Y and (at most) Z
        per_replicate = 1 + 2 * sum(interventions[i].prefix is not None for i in members)
        start = _clock(device)
        parts, fitted = _rollout_replicates(
            np.asarray(group_reps, dtype=np.int64), run, settings.max_batch_rows, per_replicate
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
                n_kept=_mean_kept(kept[specs[i].name]),
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
    eos_ids: Sequence[int],
    settings: RolloutSettings,
    prefill: Prefill | None = None,
) -> DocumentRollout:
    """Coupled rollouts of one document under one action: :func:`rollout_document_actions`
    with that action alone (same arguments, same values)."""
    action = action if isinstance(action, ActionSpec) else parse_action(action)
    return rollout_document_actions(
        model, input_ids, [action], doc_id, replicates, eos_ids, settings, prefill
    )[action.name]
