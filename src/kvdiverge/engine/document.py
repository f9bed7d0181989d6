"""One document's coupled rollouts under several actions: one prefill, each action's kept
entries gathered once, all replicates in one batch (:mod:`kvdiverge.engine.rows`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvdiverge.engine.decoding_compression import DecodingSpec
from kvdiverge.engine.generated_quantization import GeneratedQuantization
from kvdiverge.engine.kernels import fused_masked_kernel
from kvdiverge.engine.rows import (
    _Intervention,
    _rollout_replicates,
    _running_row_steps,
    _Unit,
    rollout_chunk,
)
from kvdiverge.engine.settings import (
    MASKED_MIN_FRACTION,
    ActionPaths,
    RolloutSettings,
    _check_model,
    _clock,
    model_device,
)
from kvdiverge.eviction import (
    ActionSpec,
    Prefill,
    cache_bytes,
    is_transform,
    kept_counts,
    parse_action,
    prompt_bytes,
    run_prefill,
    select_positions,
    transformed_prefix,
)
from kvdiverge.eviction.decoding import is_decoding
from kvdiverge.eviction.quantize import generated_bytes
from kvdiverge.theory.coupling import (
    document_key,
)

__all__ = [
    "DocumentRollout",
    "checked_actions",
    "gather_prefix",
    "kept_mask",
    "mean_kept",
    "reference_groups",
    "paths_under_action",
    "paths_under_actions",
]

log = logging.getLogger(__name__)


def gather_prefix(prefill: Prefill, kept: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's kept entries: (keys, values) of shape (H_kv, n_l, d). Ragged kept sets (−1
    padding, :func:`kvdiverge.eviction.select_positions`) are cut to the layer's longest head;
    where the layer's heads still differ, a third element ``mask`` (H_kv, n_l) marks the real
    entries (:class:`kvdiverge.engine.attention.SharedPrefix`)."""
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


def kept_mask(prefill: Prefill, kept: torch.Tensor) -> list[torch.Tensor] | None:
    """Each layer's kept entries as a (H_kv, n) bool mask over the full prompt (ragged kept sets'
    −1 padding ignored); ``None`` when every layer and KV head keeps every entry."""
    n = prefill.n
    masks = []
    for layer in range(kept.shape[0]):
        positions = kept[layer]
        mask = torch.zeros((positions.shape[0], n + 1), dtype=torch.bool, device=positions.device)
        mask.scatter_(1, torch.where(positions >= 0, positions, n), True)  # padding → column n
        masks.append(mask[:, :n])
    return None if all(bool(m.all()) for m in masks) else masks


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
class DocumentRollout:
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
    cache_bytes: dict[str, dict[str, list[int]]] | None = None

    @classmethod
    def plan(
        cls,
        doc_id: str,
        input_ids: Sequence[int] | torch.Tensor,
        specs: Sequence[ActionSpec],
        replicates: ReplicateCounts,
        coupling: str,
        subset: bool = False,
    ) -> DocumentRollout:
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
        self.cache_bytes = {}
        n_kv, _, head_dim = prefill.keys[0].shape
        itemsize, layers = prefill.keys[0].element_size(), len(prefill.keys)
        for a in self.specs:
            start = _clock(device)
            self.kept[a.name] = select_positions(prefill, a)
            kept = self.kept[a.name]
            identity = settings.identity_shortcut and mean_kept(kept) == prefill.n
            layout = settings.prompt_attention
            # auto: by the kept fraction (benchmarks/README.md, "Prompt attention layouts")
            if layout == "auto":
                layout = (
                    "masked" if mean_kept(kept) >= MASKED_MIN_FRACTION * prefill.n else "gathered"
                )
                # no validated fused kernel for the masked layout here (the float32 reference
                # would run it): the gathered caches, which the fused kernels take
                keys = prefill.keys[0]
                if settings.fused_attention and not fused_masked_kernel(
                    keys.device, keys.dtype, keys.shape[-1]
                ):
                    layout = "gathered"
            if is_transform(a):  # its own tensors, attended in the gathered layout
                part = transformed_prefix(prefill, a)
                aging = GeneratedQuantization.of(a)  # its rows' generated entries, as they age
                self.interventions.append(_Intervention(part, aging=aging))
            elif is_decoding(a):  # its rows' kept entries change as they decode
                spec = DecodingSpec.of(a, kept, prefill.n)
                part = gather_prefix(prefill, kept)
                self.interventions.append(_Intervention(part, decoding=spec))
            elif identity:
                self.interventions.append(_Intervention(None))
            elif layout == "masked":
                self.interventions.append(_Intervention(None, True, kept_mask(prefill, kept)))
            else:
                self.interventions.append(_Intervention(gather_prefix(prefill, kept)))
            self.selection_seconds[a.name] = _clock(device) - start
            counts = None if is_transform(a) else kept_counts(kept).tolist()
            size = prompt_bytes(a, counts, prefill.n, n_kv, head_dim, itemsize, layers)
            generated = generated_bytes(a, settings.H, n_kv, head_dim, itemsize)
            held = cache_bytes(size, settings.H, n_kv, head_dim, itemsize, generated)
            self.cache_bytes[a.name] = held.as_dict()

    def _bytes(self, name: str, arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """The action's cache bytes; a decoding action's from what its rows held (``end``: the
        mean over its replicates' Y rows at their last decoding call, rounded; ``end_rows``:
        each replicate's, per layer)."""
        held = self.cache_bytes[name]
        if "kept_entries" not in arrays:
            return held
        assert self.prefill is not None
        n_kv, _, head_dim = self.prefill.keys[0].shape
        per_entry = n_kv * 2 * head_dim * self.prefill.keys[0].element_size()
        rows = arrays["kept_entries"].astype(np.int64) * per_entry
        end = [int(round(v)) for v in rows.mean(axis=0)]
        return {**held, "end": end, "end_rows": rows.tolist()}

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
        return 1 + 2 * sum(self.interventions[i].evicting for i in members)

    def results(
        self, parts: Sequence[Sequence[list[dict[str, np.ndarray]]]], seconds: Sequence[float]
    ) -> dict[str, ActionPaths]:
        """``{action name: ActionPaths}`` from each group's chunk results in replicate
        order (``parts[g]``) and its decode seconds."""
        assert self.prefill is not None and self.kept is not None
        assert self.selection_seconds is not None
        results: dict[str, ActionPaths] = {}
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
                _running_row_steps(merged)[1] if self.interventions[i].evicting else 0
                for i, merged in zip(members, merged_parts, strict=True)
            ]
            group_rows = x_rows + sum(own)
            per_replicate = 1 + 2 * sum(self.interventions[i].evicting for i in members)
            fitted = max(len(p[0]["x_token"]) for p in group_parts)
            for j, i in enumerate(members):
                merged = merged_parts[j]
                name = self.specs[i].name
                logits = {
                    n[len("logits_") :]: v for n, v in merged.items() if n.startswith("logits_")
                }
                results[name] = ActionPaths(
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
                    cache_bytes=self._bytes(name, merged),
                    decode_seconds=group_seconds * (x_rows + own[j]) / max(group_rows, 1),
                )
        return {a.name: results[a.name] for a in self.specs}


def checked_actions(
    actions: Sequence[ActionSpec | Mapping[str, Any]], eos_ids: Sequence[int]
) -> list[ActionSpec]:
    """The actions parsed (a mapping through :func:`kvdiverge.eviction.parse_action`), refused
    in one line when no EOS id is given or two actions share a name."""
    if not eos_ids:
        raise ValueError("eos_ids: at least one EOS token id is needed")
    specs = [a if isinstance(a, ActionSpec) else parse_action(a) for a in actions]
    names = [a.name for a in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"actions: names must be unique, got {', '.join(names)}")
    return specs


def paths_under_actions(
    model: torch.nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    actions: Sequence[ActionSpec | Mapping[str, Any]],
    doc_id: str,
    replicates: ReplicateCounts,
    eos_ids: Sequence[int],
    settings: RolloutSettings,
    prefill: Prefill | None = None,
) -> dict[str, ActionPaths]:
    """Coupled rollouts of one document under several actions (``docs/method.md``).

    ONE prefill serves every action (full cache and first-token logits); each action gathers
    its kept entries from it. Actions with the same replicates share one reference stream X
    (:func:`reference_groups`); each evicting action adds its Y and Z rows. ``replicates``: K
    or explicit indices for every action, or a mapping action name → K or indices (e.g. the
    control's K_control). All rows of a reference group run in one model call per step, so an
    action's result equals :func:`paths_under_action` with that action alone to floating-point
    rounding (the batch differs). Returns ``{action name: ActionPaths}``. The groups run
    one after the other; :func:`batched_paths` fills each model call with the rows of
    several documents and groups instead.

    ``input_ids``: the chat-wrapped prompt (:func:`kvdiverge.models.chat_prompt_ids`);
    ``eos_ids``: EOS token ids, one merged outcome (:func:`kvdiverge.theory.coupling.merge_eos`);
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
    specs = checked_actions(actions, eos_ids)
    doc = DocumentRollout.plan(doc_id, input_ids, specs, replicates, settings.coupling)
    doc.prepare(model, settings, prefill)
    device = model_device(model)
    parts, seconds = [], []
    for g, (_, group_reps, _) in enumerate(doc.groups):

        def run(part: np.ndarray, g: int = g) -> list[dict]:
            unit = doc.unit(g, part)
            return rollout_chunk(
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


def paths_under_action(
    model: torch.nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    action: ActionSpec | Mapping[str, Any],
    doc_id: str,
    replicates: int | Sequence[int],
    eos_ids: Sequence[int],
    settings: RolloutSettings,
    prefill: Prefill | None = None,
) -> ActionPaths:
    """Coupled rollouts of one document under one action: :func:`paths_under_actions`
    with that action alone (same arguments, same values)."""
    action = action if isinstance(action, ActionSpec) else parse_action(action)
    return paths_under_actions(
        model, input_ids, [action], doc_id, replicates, eos_ids, settings, prefill
    )[action.name]
