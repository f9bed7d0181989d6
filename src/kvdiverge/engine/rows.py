"""The coupled decode loop: rollouts under several actions, one model call a step.

:func:`paths_under_actions` runs one document; :func:`batched_paths` (what a rollout
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
  (:mod:`kvdiverge.engine.attention`). Memory is O(prompt + K·H) per action;
* the stepwise maximal coupling (:func:`kvdiverge.theory.coupling.maximal_coupling_step`, accept
  sampler) runs every step with common random numbers: X by inverse CDF from the REFERENCE
  stream keyed by (seed, document, replicate, t) only, so X is identical across actions; ACCEPT
  and RESIDUAL streams for Y. ``coupling="independent"`` salts all streams with the action name
  (each action then has its own X rows);
* the kernels softmax(logits / T) in float64 (``settings.temperature``, default 1; T = 0 is greedy:
  the point mass on the argmax, :func:`kvdiverge.theory.coupling.tempered_kernel`); the EOS ids are
  ONE outcome of every kernel (:func:`kvdiverge.theory.coupling.merge_eos`: their probabilities are
  summed onto the smallest EOS id before the TV and the coupling, so two sequences that both end
  agree, whatever id each would have used, and results do not depend on the order of ``eos_ids``);
  an EOS outcome is recorded as that smallest id; EOS is absorbing (after it a sequence's kernel is
  the point mass on the merged outcome); H steps always; rows whose stream has ended leave the batch
  (a quarter of it at a time);
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvdiverge.engine.attention import (
    ATTENTION_NAME,
    PromptPass,
    RowCache,
    SharedPrefix,
    attention_implementation,
)
from kvdiverge.engine.decoding_compression import DecodingSpec, row_cache
from kvdiverge.engine.settings import RolloutSettings, _is_oom, _uniforms
from kvdiverge.eviction import (
    Prefill,
)
from kvdiverge.theory.coupling import (
    canonical_eos,
    maximal_coupling_step,
    merge_eos,
    tempered_kernel,
    tv,
)

__all__ = [
    "decode_step",
    "rollout_chunk",
    "rollout_units",
]

log = logging.getLogger(__name__)


@dataclass
class _Intervention:
    """One action's evicted prompt in a decoding chunk: its gathered part (``prefix``), or with
    ``masked`` its kept entries as a mask over the full prompt (per layer (H_kv, n) bool; ``mask``
    ``None``: every entry kept), attended to in the document's masked pass
    (:class:`kvdiverge.engine.attention.PromptPass`). Neither (``prefix`` ``None``, not
    ``masked``): Q is P, no rows run (the identity shortcut)."""

    prefix: list[tuple[torch.Tensor, ...]] | None
    masked: bool = False
    mask: list[torch.Tensor] | None = None
    decoding: DecodingSpec | None = None  # compression during decoding (its rows' own entries)
    aging: Any = None  # its rows' generated entries quantized as they age (GeneratedQuantization)

    @property
    def evicting(self) -> bool:
        """Whether the action runs rows of its own (Y and Z)."""
        return self.prefix is not None or self.masked


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
        return sum(act.evicting for act in self.interventions)

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
        cache_position=torch.full(
            (1,), cache.get_seq_length(), dtype=torch.long, device=tokens.device
        ),
        past_key_values=cache,
        use_cache=True,
        kvd_prefix=shared,
    )
    return result.logits[:, -1]


def _absorbed(
    kernel: torch.Tensor, done: torch.Tensor, point_mass: torch.Tensor, any_done: bool
) -> torch.Tensor:
    """The kernel with the point mass on EOS in the rows that have emitted EOS (``any_done``:
    whether some row has, known on the host from the step's one read)."""
    return torch.where(done[:, None], point_mass, kernel) if any_done else kernel


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
        passes: Sequence[PromptPass] = (),
        native: bool = True,
    ) -> None:
        device = cache.keys[0].device
        self.cache, self.fused, self.ks, self.native = cache, fused, list(ks), native
        self.passes = list(passes)
        self.flat_prompts = [part for unit in prompts for part in unit]
        self.n_streams = [2 * len(unit) - 1 for unit in prompts]
        self.reps = [torch.arange(k, device=device) for k in ks]

        def per_unit(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        self._k = per_unit(ks)
        self._slot_base = per_unit(
            _exclusive_cumsum([s * k for s, k in zip(self.n_streams, ks, strict=True)])
        )
        self._stream_base_host = _exclusive_cumsum(self.n_streams)
        self._stream_base = per_unit(self._stream_base_host)
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
        # per member: whether it holds every replicate of its unit in replicate order (its rows
        # then give the (k, V) table as they are); read once per layout, not per step
        unit_of = [u for u, n in enumerate(self.n_streams) for _ in range(n)]
        full = [
            i for i, (rows, _) in enumerate(self.members) if rows.numel() == self.ks[unit_of[i]]
        ]
        self.in_order = [False] * len(self.members)
        if full:
            checks = torch.stack(
                [(self.members[i][1] == self.reps[unit_of[i]]).all() for i in full]
            ).tolist()
            for i, ok in zip(full, checks, strict=True):
                self.in_order[i] = bool(ok)
        # X → the unit's prompt 0; Y and Z of evicted[j] → its prompt 1 + j
        group_key = self._group_base[self.unit] + (self.stream + 1) // 2
        rows = self._split(group_key, len(self.flat_prompts))
        self.shared = SharedPrefix(rows, self.flat_prompts, self.fused, self.passes, self.native)
        self.shared.decoding = self.cache if self.cache.compressing else None

    def by_replicate(
        self, values: torch.Tensor, unit: int, code: int, base: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Unit ``unit``'s stream ``code``: its (k, V) rows of ``values`` by replicate, from
        ``base`` where it has no row (an ended row, or a Z not yet split), else zeros (a point
        mass replaces them)."""
        member = self._stream_base_host[unit] + code
        batch_rows, row_reps = self.members[member]
        k = self.ks[unit]
        if base is None and self.in_order[member]:
            return values.index_select(0, batch_rows)
        part = values.index_select(0, batch_rows)
        if base is None:  # a fresh table of zeros, filled in place
            return values.new_zeros((k, values.shape[-1])).index_copy_(0, row_reps, part)
        return base.index_copy(0, row_reps, part)

    def start_z_rows(self, unit: int, j: int, new: torch.Tensor) -> None:
        """Z rows of unit ``unit``'s intervention j for replicates ``new``, from copies of their
        Y rows."""
        y_rows, y_reps = self.members[self._stream_base_host[unit] + self.y(j)]
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
        self.evicted = [i for i, act in enumerate(unit.interventions) if act.evicting]
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
        # whether some X row, and some Y row of each action, has ended: read on the host once a
        # step, with the rest of the step's decisions (:meth:`host_flags`)
        self.x_any = False
        self.y_any = [False] * n_actions

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
        p = _absorbed(p_raw, self.x_done, point_mass, self.x_any)
        x = None
        for i, fields in enumerate(self.out):
            z = self.y_stream.get(i, -2) + 1  # the Z stream's code (-1: none)
            z_rows = batch.members[batch._stream_base_host[u] + z][0].numel() if z > 0 else 0
            # no Z row, no ended X or Y row: Q on X's history is Q, row for row and bit for bit
            same = not (self.x_any or self.y_any[i] or z_rows)
            if i in self.y_stream:
                q_raw = batch.by_replicate(probs, u, self.y_stream[i])
                q_fixed_raw = q_raw if same else batch.by_replicate(probs, u, z, base=q_raw)
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
            q = _absorbed(q_raw, self.y_done[i], point_mass, self.y_any[i])
            q_fixed = _absorbed(q_fixed_raw, self.x_done, point_mass, self.x_any)
            # X ~ p by inverse CDF: the same for every q, so drawn once
            x, y = maximal_coupling_step(p, q, self.uniforms[t - 1], x=x)
            self.y_done[i] = self.y_done[i] | torch.isin(y, eos)
            fields["y_token"][:, t - 1] = y
            delta = tv(p, q)
            fields["tv_rollout"][:, t - 1] = delta
            fields["tv_fixed"][:, t - 1] = delta if same else tv(p, q_fixed)
            fields["y_eos"][:, t - 1] = self.y_done[i]
            self.split[i] = self.split[i] | (x != y)
        if x is None:  # no intervention: X alone
            x = maximal_coupling_step(p, p, self.uniforms[t - 1])[0]
        self.x = x
        self.x_done = self.x_done | torch.isin(x, eos)
        self.x_token[:, t - 1] = x
        self.x_eos[:, t - 1] = self.x_done

    def new_z(self) -> list[torch.Tensor]:
        """Per evicted intervention: the replicates newly split while X runs ((k,) bool), whose
        Z rows start now; the intervention's Z flags are updated."""
        out = []
        for i in self.evicted:
            running = ~self.x_done | self.keep_logits  # (kept logits: every Z law is recorded)
            out.append(self.split[i] & ~self.z_started[i] & running)
            self.z_started[i] = self.split[i].clone()
        return out

    def host_flags(self) -> list[torch.Tensor]:
        """Whether some X row, and some Y row of each action, has ended (0-d bool tensors, read
        with the batch's other flags into :attr:`x_any` and :attr:`y_any`)."""
        return [self.x_done.any(), *(done.any() for done in self.y_done)]

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
def rollout_units(
    model: torch.nn.Module,
    units: Sequence[_Unit],
    eos_ids: Sequence[int],
    settings: RolloutSettings,
    on_step: Callable[[int], None] | None = None,
) -> list[list[dict[str, np.ndarray]]]:
    """Coupled rollouts of every unit of a batch: per unit, per intervention, its arrays (the
    call :func:`kvdiverge.engine.batches.batched_paths` makes per batch; a unit is one
    document's reference group, or a chunk of its replicates, as the document's plan gives it).

    Each step runs ONE model call for all running rows of all units: per unit, the k reference
    rows X (its full prompt cache), each evicted intervention's k Y rows, and the Z rows (Q fed
    X's tokens, for f_t; on the intervention's evicted cache) of the (intervention, replicate)
    pairs whose X and Y histories have split, added in the order they split. Rows of units with
    prompts of different lengths decode at their own positions. Before its split a replicate's Z
    is Y itself (the same cache, the same tokens), so Q on X's history is Y's Q, bit for bit,
    and no row runs for it; at the split the Z row starts from a copy of the Y row's generated
    entries. An intervention with neither prefix nor mask (the identity shortcut) has Q := P itself
    (δ ≡ f ≡ 0, Y ≡ X) and runs no rows. The coupling of each unit uses its own uniforms, keyed
    by its document, so a unit's tokens do not depend on the other units of the batch.

    A row whose stream has ended no longer matters: an X row once X emitted EOS, a Y row once
    Y did, a Z row once X did (from then on the kernel is the point mass on EOS). With
    ``settings.drop_ended`` ended rows leave the batch when they make up a quarter of it (the
    running rows' generated entries are then moved to the front); until then they run and
    their logits are ignored. With ``settings.keep_logits`` every row stays, so that every
    stream's logits are recorded. ``on_step(t)``, when given, is called once step t of every
    row is coupled (a progress display; it sees no tensor).
    """
    H, keep_logits, temperature = settings.H, settings.keep_logits, settings.temperature
    first = units[0].prefill
    device = first.last_logits.device
    n_kv, _, d = first.keys[0].shape
    runs = [_UnitRun(unit, settings, device) for unit in units]
    evicted = [run.evicted for run in runs]
    rows = sum(unit.rows for unit in units)
    dtype = first.keys[0].dtype
    cache = row_cache(units, evicted, len(first.keys), rows, n_kv, d, max(H - 1, 1), dtype, device)
    prompts, passes = _prompt_groups(units, runs, settings.prompt_attention != "gathered")
    batch = _RowBatch(
        prompts,
        [len(unit.replicates) for unit in units],
        cache,
        settings.fused_attention,
        passes,
        settings.native_attention,
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
            probs = merge_eos(tempered_kernel(logits, temperature), eos_ids, inplace=True)
            for u, run in enumerate(runs):
                run.couple(t, batch, u, probs, logits, point_mass, eos)
            if on_step is not None:
                on_step(t)
            if t == H:
                break
            # the step's one host read: the ended rows (a Z row starting now has not ended), which
            # interventions start Z rows (newly split, X running: Z starts from Y's history) and
            # which streams have ended rows
            new = [run.new_z() for run in runs]
            tables = [run.stream_tables(t) for run in runs]
            ended = batch.per_row([table[0] for table in tables])
            flags = [ended.sum()] + [m.any() for masks in new for m in masks]
            flags += [f for run in runs for f in run.host_flags()]
            n_ended, *values = torch.stack([f.long() for f in flags]).tolist()
            changed = False
            for u, masks in enumerate(new):
                for j, mask in enumerate(masks):
                    if values.pop(0):
                        batch.start_z_rows(u, j, mask.nonzero()[:, 0])
                        changed = True
            for run in runs:
                run.x_any, *run.y_any = (bool(values.pop(0)) for _ in range(1 + len(run.y_any)))
            if changed:  # the new Z rows' entries (not ended)
                ended = batch.per_row([table[0] for table in tables])
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
            if cache.compressing:  # compression during decoding: each row from its own history
                cache.after_call(batch.shared)
            if cache.aging is not None:  # generated entries quantized as they age, per row
                cache.aging.after_call(cache, batch.shared)
    arrays = [run.arrays() for run in runs]
    if cache.compressing:
        cache.add_outcomes(arrays, evicted)
    return arrays


def _prompt_groups(
    units: Sequence[_Unit], runs: Sequence[_UnitRun], masked_pass: bool
) -> tuple[list[list[list[tuple[torch.Tensor, ...]]]], list[PromptPass]]:
    """Per unit, the prompt part of each row group (X's full prompt, then each evicting
    intervention's), and the masked passes: with ``masked_pass`` one per unit, over its full
    prompt, holding its X group and its masked interventions' groups (whose entry of the prompt
    parts is then the full prompt, not read)."""
    prompts, passes, base = [], [], 0
    for unit, run in zip(units, runs, strict=True):
        acts = [unit.interventions[i] for i in run.evicted]
        full = unit.prefix_full
        prompts.append([full] + [full if act.masked else list(act.prefix) for act in acts])
        if masked_pass:
            chosen = [j for j, act in enumerate(acts) if act.masked]
            groups = [base] + [base + 1 + j for j in chosen]
            masks = [None] + [acts[j].mask for j in chosen]
            passes.append(PromptPass(groups, full, masks))
        base += 1 + len(acts)
    return prompts, passes


@torch.inference_mode()
def rollout_chunk(
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
    one X stream: :func:`rollout_units` with this one unit (``prefix_full`` is the prefill's
    own cache)."""
    unit = _Unit(prefill, list(interventions), np.asarray(replicates), doc_key, salt)
    return rollout_units(model, [unit], eos_ids, settings)[0]


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
