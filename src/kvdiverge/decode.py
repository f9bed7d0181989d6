"""The coupled decode loop: rollouts under several actions, one model call a step.

:func:`rollout_document_actions` runs one document; :func:`rollout_documents` (what a rollout
job runs) fills each model call with the rows of several documents, each with its own prompt
groups, positions and common random numbers (``docs/architecture.md``, "Coupled decoding":
several documents per model call).

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
from collections.abc import Iterator, Mapping, Sequence
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
    "decode_step",
    "gather_prefix",
    "mean_kept",
    "model_device",
    "plan_batches",
    "reference_groups",
    "rollout_document",
    "rollout_document_actions",
    "rollout_documents",
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
    document_seconds: float = 0.0  # the document's prefill, selections and share of decoding


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


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
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


@dataclass
class _Unit:
    """One document's reference group (or a chunk of its replicates) in a decoding batch.

    A unit is what one document contributes to a batch: its prefill (full prompt cache and
    first-token logits), the members' interventions, the replicates and the key of its common
    random numbers (document and salt). Units of different documents share the model calls of
    a batch, each with its own prompt groups.
    """

    prefill: Prefill
    interventions: list[_Intervention]
    replicates: np.ndarray
    doc_key: int
    salt: int

    @property
    def prefix_full(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.prefill.keys, self.prefill.values, strict=True))

    @property
    def n_evicting(self) -> int:
        return sum(act.prefix is not None for act in self.interventions)

    @property
    def rows(self) -> int:
        """The most batch rows the unit holds: X, and Y and Z per evicting intervention."""
        return len(self.replicates) * (1 + 2 * self.n_evicting)


def decode_step(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    position: int | torch.Tensor,
    cache: RowCache,
    shared: SharedPrefix,
) -> torch.Tensor:
    """One batched decoding step of ``tokens`` (B,): logits (B, V).

    ``position``: the prompt offset of every row (one int: one rotary row broadcasts over the
    batch), or a (B,) tensor when the rows belong to prompts of different lengths.
    """
    if isinstance(position, int):
        position_ids = torch.full((1, 1), position, dtype=torch.long, device=tokens.device)
    else:
        position_ids = position[:, None]
    result = model(
        input_ids=tokens[:, None],
        position_ids=position_ids,
        cache_position=torch.tensor([cache.get_seq_length()], device=tokens.device),
        past_key_values=cache,
        use_cache=True,
        kvd_prefix=shared,
    )
    return result.logits[:, -1]


def _absorbed(kernel: torch.Tensor, done: torch.Tensor, point_mass: torch.Tensor) -> torch.Tensor:
    """The kernel with the point mass on EOS in the rows that have emitted EOS."""
    return torch.where(done[:, None], point_mass, kernel) if bool(done.any()) else kernel


def _exclusive_cumsum(values: Sequence[int]) -> list[int]:
    return [int(v) for v in np.concatenate([[0], np.cumsum(values)[:-1]])]


class _RowBatch:
    """The rows of one decoding batch (one or more units) and the prompt part each attends to.

    Streams of a unit: 0 is X; for its j-th evicting intervention, ``y(j) = 1 + 2j`` is the Y
    stream and ``y(j) + 1`` the Z stream. Per batch row, ``unit``, ``stream`` and
    ``replicate`` (the unit's replicate position) say what it decodes; the rows start unit by
    unit (each unit's X rows, then its Y rows), Z rows are appended as histories split. Row
    group (u, 0), the X rows of unit u, attends to the unit's full prompt; group (u, 1 + j), the
    Y and Z rows of its j-th evicting intervention, to that intervention's evicted prompt.
    """

    def __init__(
        self,
        prompts: list[list[list[tuple[torch.Tensor, ...]]]],
        ks: Sequence[int],
        cache: RowCache,
        fused: bool,
    ) -> None:
        device = cache.keys[0].device
        self.cache, self.fused, self.ks = cache, fused, list(ks)
        self.flat_prompts = [part for unit in prompts for part in unit]
        self.n_streams = [2 * len(unit) - 1 for unit in prompts]
        self.reps = [torch.arange(k, device=device) for k in ks]

        def per_unit(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        self._k = per_unit(ks)
        self._slot_base = per_unit(
            _exclusive_cumsum([s * k for s, k in zip(self.n_streams, ks, strict=True)])
        )
        self._stream_base = per_unit(_exclusive_cumsum(self.n_streams))
        self._group_base = per_unit(_exclusive_cumsum([len(unit) for unit in prompts]))
        units, streams, replicates = [], [], []
        for u, (unit, k) in enumerate(zip(prompts, ks, strict=True)):
            group = torch.arange(len(unit), device=device).repeat_interleave(k)
            streams.append(torch.where(group > 0, 2 * group - 1, 0))
            replicates.append(self.reps[u].repeat(len(unit)))
            units.append(torch.full_like(group, u))
        self.unit = torch.cat(units)
        self.stream = torch.cat(streams)
        self.replicate = torch.cat(replicates)
        cache.rows = self.stream.numel()
        self._layout()

    @staticmethod
    def y(j: int) -> int:
        """Stream code of the j-th evicting intervention's Y rows (its Z rows: ``y(j) + 1``)."""
        return 1 + 2 * j

    def _split(self, key: torch.Tensor, n_keys: int) -> list[torch.Tensor]:
        """The batch rows of each key 0..n_keys − 1, each in ascending row order."""
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=n_keys).tolist()
        return list(torch.split(order, counts))

    def _layout(self) -> None:
        stream_key = self._stream_base[self.unit] + self.stream
        members = self._split(stream_key, sum(self.n_streams))
        self.members = [(rows, self.replicate[rows]) for rows in members]
        # X → the unit's prompt 0; Y and Z of evicted[j] → its prompt 1 + j
        group_key = self._group_base[self.unit] + (self.stream + 1) // 2
        rows = self._split(group_key, len(self.flat_prompts))
        self.shared = SharedPrefix(rows, self.flat_prompts, self.fused)

    def by_replicate(
        self, values: torch.Tensor, unit: int, code: int, base: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Unit ``unit``'s stream ``code``: its (k, V) rows of ``values`` by replicate, from
        ``base`` where it has no row (an ended row, or a Z not yet split), else zeros (a point
        mass replaces them)."""
        batch_rows, row_reps = self.members[int(self._stream_base[unit]) + code]
        k, reps = self.ks[unit], self.reps[unit]
        if base is None and batch_rows.numel() == k and bool((row_reps == reps).all()):
            return values.index_select(0, batch_rows)
        start = values.new_zeros((k, values.shape[-1]))
        return (start if base is None else base).index_copy(
            0, row_reps, values.index_select(0, batch_rows)
        )

    def start_z_rows(self, unit: int, j: int, new: torch.Tensor) -> None:
        """Z rows of unit ``unit``'s intervention j for replicates ``new``, from copies of their
        Y rows."""
        y_rows, y_reps = self.members[int(self._stream_base[unit]) + self.y(j)]
        source = torch.full((self.ks[unit],), -1, dtype=torch.long, device=new.device)
        source[y_reps] = y_rows
        cache = self.cache
        slots = torch.arange(cache.rows, cache.rows + new.numel(), device=new.device)
        cache.copy_rows(source[new], slots)
        cache.rows += new.numel()
        self.unit = torch.cat([self.unit, torch.full_like(new, unit)])
        self.stream = torch.cat([self.stream, torch.full_like(new, self.y(j) + 1)])
        self.replicate = torch.cat([self.replicate, new])

    def per_row(self, tables: Sequence[torch.Tensor]) -> torch.Tensor:
        """Each batch row's entry of its unit's (streams, k) table (the rows as they are now,
        Z rows just started included)."""
        slot = self._slot_base[self.unit] + self.stream * self._k[self.unit] + self.replicate
        return torch.cat([table.reshape(-1) for table in tables])[slot]

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (their cache entries move to the front)."""
        self.cache.keep_rows(rows)
        self.unit, self.stream = self.unit[rows], self.stream[rows]
        self.replicate = self.replicate[rows]

    def relayout(self) -> None:
        self._layout()


class _UnitRun:
    """The coupled state of one unit across the steps of a batch: its tokens, EOS flags, δ and
    f, split and Z flags, uniforms and (with ``keep_logits``) every stream's logits."""

    FIELDS = (
        ("y_token", torch.long),
        ("tv_rollout", torch.float64),
        ("tv_fixed", torch.float64),
        ("y_eos", torch.bool),
    )

    def __init__(self, unit: _Unit, settings: RolloutSettings, device: torch.device) -> None:
        H, k = settings.H, len(unit.replicates)
        self.keep_logits = settings.keep_logits
        self.evicted = [i for i, act in enumerate(unit.interventions) if act.prefix is not None]
        self.y_stream = {i: _RowBatch.y(j) for j, i in enumerate(self.evicted)}
        n_actions = len(unit.interventions)
        self.out = [
            {name: torch.empty((k, H), dtype=kind, device=device) for name, kind in self.FIELDS}
            for _ in range(n_actions)
        ]
        self.x_token = torch.empty((k, H), dtype=torch.long, device=device)
        self.x_eos = torch.empty((k, H), dtype=torch.bool, device=device)
        self.kept_logits: list[dict[str, list[torch.Tensor]]] = [
            {"p": [], "q": [], "q_fixed": []} for _ in range(n_actions)
        ]
        self.uniforms = _uniforms(
            settings.seed, unit.doc_key, unit.replicates, H, unit.salt, device
        )
        self.x_done = torch.zeros(k, dtype=torch.bool, device=device)
        self.y_done = [torch.zeros(k, dtype=torch.bool, device=device) for _ in range(n_actions)]
        self.split = [torch.zeros(k, dtype=torch.bool, device=device) for _ in range(n_actions)]
        self.z_started = {i: torch.zeros(k, dtype=torch.bool, device=device) for i in self.evicted}
        self.x = self.x_done.long()

    def couple(
        self,
        t: int,
        batch: _RowBatch,
        u: int,
        probs: torch.Tensor,
        logits: torch.Tensor,
        point_mass: torch.Tensor,
        eos: torch.Tensor,
    ) -> None:
        """Step t: the laws P, Q and Q on X's history from the batch's ``probs``, δ_t and f_t,
        and the coupled draws of X and every Y."""
        p_raw = batch.by_replicate(probs, u, 0)
        p = _absorbed(p_raw, self.x_done, point_mass)
        x = None
        for i, fields in enumerate(self.out):
            if i in self.y_stream:
                q_raw = batch.by_replicate(probs, u, self.y_stream[i])
                q_fixed_raw = batch.by_replicate(probs, u, self.y_stream[i] + 1, base=q_raw)
            else:  # the identity shortcut: Q is P as a kernel
                q_raw = q_fixed_raw = p_raw
            if self.keep_logits:
                lp = batch.by_replicate(logits, u, 0)
                lq = batch.by_replicate(logits, u, self.y_stream[i]) if i in self.y_stream else lp
                lz = (
                    batch.by_replicate(logits, u, self.y_stream[i] + 1, base=lq)
                    if i in self.y_stream
                    else lp
                )
                for name, part in zip(("p", "q", "q_fixed"), (lp, lq, lz), strict=True):
                    self.kept_logits[i][name].append(part.float().cpu())
            q = _absorbed(q_raw, self.y_done[i], point_mass)
            q_fixed = _absorbed(q_fixed_raw, self.x_done, point_mass)
            x_i, y = maximal_coupling_step(p, q, self.uniforms[t - 1])
            x = x_i if x is None else x  # X ~ p by inverse CDF: the same for every q
            self.y_done[i] = self.y_done[i] | torch.isin(y, eos)
            fields["y_token"][:, t - 1] = y
            fields["tv_rollout"][:, t - 1] = tv(p, q)
            fields["tv_fixed"][:, t - 1] = tv(p, q_fixed)
            fields["y_eos"][:, t - 1] = self.y_done[i]
            self.split[i] = self.split[i] | (x != y)
        if x is None:  # no intervention: X alone
            x = maximal_coupling_step(p, p, self.uniforms[t - 1])[0]
        self.x = x
        self.x_done = self.x_done | torch.isin(x, eos)
        self.x_token[:, t - 1] = x
        self.x_eos[:, t - 1] = self.x_done

    def start_z_rows(self, batch: _RowBatch, u: int) -> bool:
        """Z rows for the replicates newly split while X runs; whether any started."""
        started = False
        for j, i in enumerate(self.evicted):
            running = ~self.x_done | self.keep_logits  # (kept logits: every Z law is recorded)
            new = (self.split[i] & ~self.z_started[i] & running).nonzero()[:, 0]
            self.z_started[i] = self.split[i].clone()
            if new.numel():
                batch.start_z_rows(u, j, new)
                started = True
        return started

    def stream_tables(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per stream and replicate: whether the stream has ended (X and Z after X's EOS, Y
        after Y's), and its next input (X's token for X and Z, Y's for Y)."""
        ended = [self.x_done] + [e for i in self.evicted for e in (self.y_done[i], self.x_done)]
        y = [self.out[i]["y_token"][:, t - 1] for i in self.evicted]
        tokens = [self.x] + [s for y_i in y for s in (y_i, self.x)]
        return torch.stack(ended), torch.stack(tokens)

    def arrays(self) -> list[dict[str, np.ndarray]]:
        """Per intervention: its (k, H) arrays (with ``keep_logits`` also (k, H, V) logits)."""
        x_arrays = {"x_token": self.x_token.cpu().numpy(), "x_eos": self.x_eos.cpu().numpy()}
        results = []
        for i, fields in enumerate(self.out):
            arrays = {**x_arrays, **{name: v.cpu().numpy() for name, v in fields.items()}}
            if self.keep_logits:
                for name, parts in self.kept_logits[i].items():
                    arrays[f"logits_{name}"] = torch.stack(parts, dim=1).numpy()
            results.append(arrays)
        return results


@torch.inference_mode()
def _rollout_units(
    model: torch.nn.Module,
    units: Sequence[_Unit],
    eos_ids: Sequence[int],
    settings: RolloutSettings,
) -> list[list[dict[str, np.ndarray]]]:
    """Coupled rollouts of every unit of a batch: per unit, per intervention, its arrays.

    Each step runs ONE model call for all running rows of all units: per unit, the k reference
    rows X (its full prompt cache), each evicted intervention's k Y rows, and the Z rows (Q fed
    X's tokens, for f_t; on the intervention's evicted cache) of the (intervention, replicate)
    pairs whose X and Y histories have split, added in the order they split. Rows of units with
    prompts of different lengths decode at their own positions. Before its split a replicate's Z
    is Y itself (the same cache, the same tokens), so Q on X's history is Y's Q, bit for bit,
    and no row runs for it; at the split the Z row starts from a copy of the Y row's generated
    entries. An intervention with ``prefix=None`` (the identity shortcut) has Q := P itself
    (δ ≡ f ≡ 0, Y ≡ X) and runs no rows. The coupling of each unit uses its own uniforms, keyed
    by its document, so a unit's tokens do not depend on the other units of the batch.

    A row whose stream has ended no longer matters: an X row once X emitted EOS, a Y row once
    Y did, a Z row once X did (from then on the kernel is the point mass on EOS). With
    ``settings.drop_ended`` ended rows leave the batch when they make up a quarter of it (the
    running rows' generated entries are then moved to the front); until then they run and
    their logits are ignored. With ``settings.keep_logits`` every row stays, so that every
    stream's logits are recorded.
    """
    H, keep_logits = settings.H, settings.keep_logits
    first = units[0].prefill
    device = first.last_logits.device
    n_kv, _, d = first.keys[0].shape
    cache = RowCache(
        len(first.keys),
        sum(unit.rows for unit in units),
        n_kv,
        d,
        max(H - 1, 1),
        first.keys[0].dtype,
        device,
    )
    runs = [_UnitRun(unit, settings, device) for unit in units]
    prompts = [
        [unit.prefix_full] + [list(unit.interventions[i].prefix) for i in run.evicted]
        for unit, run in zip(units, runs, strict=True)
    ]
    batch = _RowBatch(
        prompts, [len(unit.replicates) for unit in units], cache, settings.fused_attention
    )
    eos = torch.tensor(sorted({int(e) for e in eos_ids}), device=device)
    firsts = torch.stack([unit.prefill.last_logits.float().reshape(-1) for unit in units])
    vocab = firsts.shape[-1]
    point_mass = torch.zeros(vocab, dtype=torch.float64, device=device)
    point_mass[canonical_eos(eos_ids)] = 1.0
    lengths = [unit.prefill.n for unit in units]
    same_length = len(set(lengths)) == 1
    prompt_n = torch.tensor(lengths, dtype=torch.long, device=device)
    # this step's logits of every batch row (step 1: each unit's prefill logits)
    logits = firsts[0].expand(cache.rows, vocab) if len(units) == 1 else firsts[batch.unit]

    with attention_implementation(model, ATTENTION_NAME):
        for t in range(1, H + 1):
            probs = merge_eos(logits.double().softmax(dim=-1), eos_ids, inplace=True)
            for u, run in enumerate(runs):
                run.couple(t, batch, u, probs, logits, point_mass, eos)
            if t == H:
                break
            changed = False
            for u, run in enumerate(runs):  # newly split, X running: Z starts from Y's history
                changed = run.start_z_rows(batch, u) or changed
            tables = [run.stream_tables(t) for run in runs]
            ended = batch.per_row([table[0] for table in tables])
            n_ended = int(ended.sum())
            if not keep_logits and settings.drop_ended and n_ended and 4 * n_ended >= ended.numel():
                batch.keep((~ended).nonzero()[:, 0])
                changed = True
            if changed:
                batch.relayout()
            if cache.rows == 0:  # every stream has ended: point masses from here on
                logits = firsts.new_zeros((0, vocab))
                continue
            tokens = batch.per_row([table[1] for table in tables])
            position = lengths[0] + t - 1 if same_length else prompt_n[batch.unit] + (t - 1)
            logits = decode_step(model, tokens, position, cache, batch.shared)
    return [run.arrays() for run in runs]


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
    """Coupled rollouts of ``replicates`` of one document under every intervention, sharing
    one X stream: :func:`_rollout_units` with this one unit (``prefix_full`` is the prefill's
    own cache)."""
    unit = _Unit(prefill, list(interventions), np.asarray(replicates), doc_key, salt)
    return _rollout_units(model, [unit], eos_ids, settings)[0]


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


def gather_prefix(prefill: Prefill, kept: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
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


def mean_kept(kept: torch.Tensor) -> int:
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


ReplicateCounts = int | Sequence[int] | Mapping[str, int | Sequence[int]]


@dataclass
class _Document:
    """One document of a rollout: what it runs (planned without the model), then its prefill,
    each action's kept set and prompt part, and the seconds they took (:meth:`prepare`)."""

    doc_id: str
    input_ids: Sequence[int] | torch.Tensor
    specs: list[ActionSpec]
    reps: dict[str, np.ndarray]
    groups: list[tuple[int, tuple[int, ...], list[int]]]
    prefill: Prefill | None = None
    kept: dict[str, torch.Tensor] | None = None
    interventions: list[_Intervention] | None = None
    prefill_seconds: float = 0.0
    selection_seconds: dict[str, float] | None = None

    @classmethod
    def plan(
        cls,
        doc_id: str,
        input_ids: Sequence[int] | torch.Tensor,
        specs: Sequence[ActionSpec],
        replicates: ReplicateCounts,
        coupling: str,
        subset: bool = False,
    ) -> _Document:
        """The document's actions, replicates and reference groups. ``replicates``: K or
        indices for every action, or a mapping action name → K or indices; with ``subset`` a
        mapping may leave actions out (the document does not run them), else it names all."""
        names = [a.name for a in specs]
        if isinstance(replicates, Mapping):
            unknown = [name for name in replicates if name not in names]
            if unknown:
                raise ValueError(
                    f"document {doc_id}: replicates for unknown action(s) {', '.join(unknown)}"
                )
            missing = [name for name in names if name not in replicates]
            if missing and not subset:
                raise ValueError(
                    f"replicates: no replicate count for action(s) {', '.join(missing)}"
                )
            specs = [a for a in specs if a.name in replicates]
            reps = {a.name: _replicate_indices(replicates[a.name]) for a in specs}
        else:
            reps = {a.name: _replicate_indices(replicates) for a in specs}
        specs = list(specs)
        return cls(doc_id, input_ids, specs, reps, reference_groups(specs, reps, coupling))

    def prepare(
        self, model: torch.nn.Module, settings: RolloutSettings, prefill: Prefill | None = None
    ) -> None:
        """One prefill for all the actions (unless given), then each action's selection and
        gather (timed per action)."""
        device = model_device(model)
        if prefill is None:
            start = _clock(device)
            prefill = run_prefill(model, self.input_ids, actions=self.specs)
            self.prefill_seconds = _clock(device) - start
        _check_model(model, prefill.n, settings.H)
        self.prefill, self.kept, self.interventions, self.selection_seconds = prefill, {}, [], {}
        for a in self.specs:
            start = _clock(device)
            self.kept[a.name] = select_positions(prefill, a)
            identity = settings.identity_shortcut and mean_kept(self.kept[a.name]) == prefill.n
            self.interventions.append(
                _Intervention(None if identity else gather_prefix(prefill, self.kept[a.name]))
            )
            self.selection_seconds[a.name] = _clock(device) - start

    def release(self) -> None:
        """Drop the prefill and the prompt parts (the document's rollouts are done)."""
        self.prefill = self.kept = self.interventions = None

    def unit(self, group: int, replicates: np.ndarray) -> _Unit:
        """Reference group ``group``'s unit for ``replicates``."""
        salt, _, members = self.groups[group]
        assert self.prefill is not None and self.interventions is not None
        interventions = [self.interventions[i] for i in members]
        return _Unit(self.prefill, interventions, replicates, document_key(self.doc_id), salt)

    def rows_per_replicate(self, group: int) -> int:
        """Batch rows per replicate of group ``group``: X, and each evicting member's Y and (at
        most) Z; before the selection (no prompt parts yet) every member counts as evicting."""
        members = self.groups[group][2]
        if self.interventions is None:
            return 1 + 2 * len(members)
        return 1 + 2 * sum(self.interventions[i].prefix is not None for i in members)

    def results(
        self, parts: Sequence[Sequence[list[dict[str, np.ndarray]]]], seconds: Sequence[float]
    ) -> dict[str, DocumentRollout]:
        """``{action name: DocumentRollout}`` from each group's chunk results in replicate
        order (``parts[g]``) and its decode seconds."""
        assert self.prefill is not None and self.kept is not None
        assert self.selection_seconds is not None
        results: dict[str, DocumentRollout] = {}
        for (_, _, members), group_parts, group_seconds in zip(
            self.groups, parts, seconds, strict=True
        ):
            merged_parts = [
                {
                    name: np.concatenate([p[j][name] for p in group_parts])
                    for name in group_parts[0][j]
                }
                for j in range(len(members))
            ]
            # row-steps the group's model calls ran: X's (shared), each member's Y and Z rows
            x_rows = _running_row_steps(merged_parts[0])[0]
            own = [
                0 if self.interventions[i].prefix is None else _running_row_steps(merged)[1]
                for i, merged in zip(members, merged_parts, strict=True)
            ]
            group_rows = x_rows + sum(own)
            per_replicate = 1 + 2 * sum(self.interventions[i].prefix is not None for i in members)
            fitted = max(len(p[0]["x_token"]) for p in group_parts)
            for j, i in enumerate(members):
                merged = merged_parts[j]
                name = self.specs[i].name
                logits = {
                    n[len("logits_") :]: v for n, v in merged.items() if n.startswith("logits_")
                }
                results[name] = DocumentRollout(
                    doc_id=self.doc_id,
                    replicates=self.reps[name],
                    x_token=merged["x_token"],
                    y_token=merged["y_token"],
                    tv_rollout=merged["tv_rollout"],
                    tv_fixed=merged["tv_fixed"],
                    x_eos=merged["x_eos"],
                    y_eos=merged["y_eos"],
                    n_prompt=self.prefill.n,
                    n_kept=mean_kept(self.kept[name]),
                    batch_rows=per_replicate * fitted,
                    rows_per_replicate=per_replicate,
                    logits=logits or None,
                    prefill_seconds=self.prefill_seconds,
                    selection_seconds=self.selection_seconds[name],
                    decode_seconds=group_seconds * (x_rows + own[j]) / max(group_rows, 1),
                )
        return {a.name: results[a.name] for a in self.specs}


def _check_actions(
    actions: Sequence[ActionSpec | Mapping[str, Any]], eos_ids: Sequence[int]
) -> list[ActionSpec]:
    if not eos_ids:
        raise ValueError("eos_ids: at least one EOS token id is needed")
    specs = [a if isinstance(a, ActionSpec) else parse_action(a) for a in actions]
    names = [a.name for a in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"actions: names must be unique, got {', '.join(names)}")
    return specs


def rollout_document_actions(
    model: torch.nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    actions: Sequence[ActionSpec | Mapping[str, Any]],
    doc_id: str,
    replicates: ReplicateCounts,
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
    rounding (the batch differs). Returns ``{action name: DocumentRollout}``. The groups run
    one after the other; :func:`rollout_documents` fills each model call with the rows of
    several documents and groups instead.

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
    specs = _check_actions(actions, eos_ids)
    doc = _Document.plan(doc_id, input_ids, specs, replicates, settings.coupling)
    doc.prepare(model, settings, prefill)
    device = model_device(model)
    parts, seconds = [], []
    for g, (_, group_reps, _) in enumerate(doc.groups):

        def run(part: np.ndarray, g: int = g) -> list[dict]:
            unit = doc.unit(g, part)
            return _rollout_chunk(
                model,
                unit.prefill,
                unit.prefix_full,
                unit.interventions,
                part,
                unit.doc_key,
                eos_ids,
                unit.salt,
                settings,
            )

        start = _clock(device)
        group_parts, _ = _rollout_replicates(
            np.asarray(group_reps, dtype=np.int64),
            run,
            settings.max_batch_rows,
            doc.rows_per_replicate(g),
        )
        seconds.append(_clock(device) - start)
        parts.append(group_parts)
    out = doc.results(parts, seconds)
    for result in out.values():
        result.document_seconds = doc.prefill_seconds + sum(doc.selection_seconds.values())
        result.document_seconds += sum(seconds)
    return out


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


# ---- several documents per model call ------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    """A planned part of a batch: document ``doc``'s reference group ``group``, replicates
    ``replicates`` (all of the group's, or a chunk), at most ``rows`` batch rows."""

    doc: int
    group: int
    replicates: np.ndarray
    rows: int


def plan_batches(
    rows_per_replicate: Sequence[Sequence[int]],
    replicates: Sequence[Sequence[Sequence[int]]],
    max_rows: int,
) -> list[list[_Piece]]:
    """Pack the documents' reference groups, in order, into batches of at most ``max_rows``
    rows.

    ``rows_per_replicate[d][g]`` and ``replicates[d][g]``: document d's group g. A group that
    alone exceeds ``max_rows`` is cut into chunks of ``max_rows // rows_per_replicate``
    replicates (at least one); pieces are added to the current batch while its rows fit,
    else a new batch starts. The plan depends only on these arguments, so a rerun (or a resumed
    job) runs the same batches.
    """
    batches: list[list[_Piece]] = [[]]
    used = 0
    for d, (per_group, reps_group) in enumerate(zip(rows_per_replicate, replicates, strict=True)):
        for g, (per, reps) in enumerate(zip(per_group, reps_group, strict=True)):
            reps = np.asarray(reps, dtype=np.int64)
            chunk = max(1, max_rows // per)
            for i in range(0, len(reps), chunk):
                part = reps[i : i + chunk]
                rows = per * len(part)
                if batches[-1] and used + rows > max_rows:
                    batches.append([])
                    used = 0
                batches[-1].append(_Piece(d, g, part, rows))
                used += rows
    return [batch for batch in batches if batch]


def _unit_row_steps(arrays: Sequence[Mapping[str, np.ndarray]], unit: _Unit) -> int:
    """Running row-steps of a unit: its X rows' once, each evicting intervention's own."""
    own = [
        _running_row_steps(a)[1]
        for a, act in zip(arrays, unit.interventions, strict=True)
        if act.prefix is not None
    ]
    return _running_row_steps(arrays[0])[0] + sum(own)


def _halves(pieces: list[_Piece]) -> list[list[_Piece]]:
    """A batch cut in two: its pieces in halves, or one piece's replicates in halves."""
    if len(pieces) > 1:
        half = len(pieces) // 2
        return [pieces[:half], pieces[half:]]
    (p,) = pieces
    half = len(p.replicates) // 2
    per = p.rows // len(p.replicates)
    return [
        [_Piece(p.doc, p.group, reps, per * len(reps))]
        for reps in (p.replicates[:half], p.replicates[half:])
    ]


def rollout_documents(
    model: torch.nn.Module,
    documents: Sequence[tuple[Any, ...]],
    actions: Sequence[ActionSpec | Mapping[str, Any]],
    eos_ids: Sequence[int],
    settings: RolloutSettings,
    skip: Any = None,
) -> Iterator[tuple[str, dict[str, DocumentRollout]]]:
    """Coupled rollouts of many documents, the rows of several documents in each model call.

    ``documents``: ``(doc_id, input_ids, replicates)``; ``replicates`` as in
    :func:`rollout_document_actions`, or a mapping that names only the actions the document
    runs; a fourth element, the document's :class:`kvdiverge.eviction.Prefill` for these
    actions, saves its prefill (benchmarks). Every argument is checked before any model call.
    The documents' reference groups are packed in order into batches of at most
    ``settings.max_batch_rows`` rows (:func:`plan_batches`; every member of a group counted as
    evicting); each batch decodes as one model call per step, each document with its own
    prompt groups, positions and common random numbers (:func:`_rollout_units`). A document
    is prefilled (once, for all its actions) when its first batch runs and released after its
    last. Yields ``(doc_id, {action name: DocumentRollout})`` in document order as each
    document's batches finish.

    A document's results equal its :func:`rollout_document_actions` run to floating-point
    rounding (the matrix products' batch differs; the tokens differ only where a uniform falls
    within rounding of a CDF boundary), and a rerun is bit-identical. ``skip(doc_id)`` true:
    the document is not yielded, and a batch all of whose documents are skipped does not run
    (a resumed job); a batch that holds other documents runs whole, so that every document's
    bits equal an uninterrupted run's. On out-of-memory a batch is cut in halves (pieces, or a
    piece's replicates) and the budget of later batches drops to the size that fitted.

    Seconds (as in :func:`rollout_document_actions`): a batch's decode seconds are shared by
    its units in proportion to their running row-steps; ``document_seconds`` of each result is
    the document's prefill, selections and share of the decode.
    """
    specs = _check_actions(actions, eos_ids)
    docs = [
        _Document.plan(doc_id, ids, specs, reps, settings.coupling, subset=True)
        for doc_id, ids, reps, *_ in documents
    ]
    given = {doc[0]: doc[3] for doc in documents if len(doc) > 3}  # prefills passed in
    seen = [d.doc_id for d in docs]
    if len(set(seen)) != len(seen):
        raise ValueError("documents: doc_id values are not unique")
    skip = skip or (lambda doc_id: False)
    plan = plan_batches(
        [[d.rows_per_replicate(g) for g in range(len(d.groups))] for d in docs],
        [[reps for _, reps, _ in d.groups] for d in docs],
        settings.max_batch_rows,
    )
    last_batch = {piece.doc: b for b, batch in enumerate(plan) for piece in batch}
    parts = [[[] for _ in doc.groups] for doc in docs]  # per document and group: chunk arrays
    seconds = [[0.0] * len(doc.groups) for doc in docs]
    budget = [settings.max_batch_rows]  # lowered after an out-of-memory split
    next_doc = 0  # documents are yielded in order, once their last batch has run
    for b, batch in enumerate(plan):
        indices = sorted({piece.doc for piece in batch})
        if not all(skip(docs[d].doc_id) for d in indices):
            for d in indices:
                if docs[d].prefill is None:
                    docs[d].prepare(model, settings, given.get(docs[d].doc_id))
            for pieces, arrays, share in _run_batch(model, docs, batch, eos_ids, settings, budget):
                for piece, piece_arrays, piece_seconds in zip(pieces, arrays, share, strict=True):
                    parts[piece.doc][piece.group].append(piece_arrays)
                    seconds[piece.doc][piece.group] += piece_seconds
        while next_doc < len(docs) and last_batch.get(next_doc, b) <= b:
            doc = docs[next_doc]
            if not skip(doc.doc_id) and doc.groups:
                out = doc.results(parts[next_doc], seconds[next_doc])
                assert doc.selection_seconds is not None
                own = doc.prefill_seconds + sum(doc.selection_seconds.values())
                for result in out.values():
                    result.document_seconds = own + sum(seconds[next_doc])
                yield doc.doc_id, out
            doc.release()
            parts[next_doc] = []
            next_doc += 1


def _run_batch(
    model: torch.nn.Module,
    docs: Sequence[_Document],
    batch: list[_Piece],
    eos_ids: Sequence[int],
    settings: RolloutSettings,
    budget: list[int],
) -> Iterator[tuple[list[_Piece], list[list[dict[str, np.ndarray]]], list[float]]]:
    """Decode one planned batch: yields (pieces, their arrays, their decode seconds) per model
    batch that ran. A batch above ``budget[0]`` rows (lowered by an earlier out-of-memory) is
    cut in halves first; on out-of-memory it is cut in halves and ``budget[0]`` lowered. A
    batch's seconds are shared by its units in proportion to their running row-steps."""
    device = model_device(model)
    pending = [batch]
    while pending:
        pieces = pending.pop(0)
        rows = sum(p.rows for p in pieces)
        splittable = len(pieces) > 1 or len(pieces[0].replicates) > 1
        if rows > budget[0] and splittable:
            pending[:0] = _halves(pieces)
            continue
        units = [docs[p.doc].unit(p.group, p.replicates) for p in pieces]
        start = _clock(device)
        try:
            arrays = _rollout_units(model, units, eos_ids, settings)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not _is_oom(exc) or not splittable:
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            budget[0] = min(budget[0], rows // 2)
            log.warning("out of memory with %d batch rows; splitting into halves", rows)
            pending[:0] = _halves(pieces)
            continue
        batch_seconds = _clock(device) - start
        steps = [_unit_row_steps(a, unit) for a, unit in zip(arrays, units, strict=True)]
        total = max(sum(steps), 1)
        yield pieces, arrays, [batch_seconds * s / total for s in steps]
