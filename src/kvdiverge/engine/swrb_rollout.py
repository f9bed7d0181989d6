"""Survival-weighted residual branching for language-model rollouts.

`docs/method.md`, "Survival-weighted residual branching": the finite-state estimator
(:func:`kvdiverge.theory.finite_state.swrb_replicates`) needs no finite state space, only P and Q
on one
shared history, the two residual laws at one step and the ordinary coupled rollout. Per
document, action a and replicate r this module runs, with the engine's batching
(:mod:`kvdiverge.engine.attention`: every prompt cache is held once and shared by its rows):

1. The overlap scan. Two rows per (action, replicate): the P row on the full prompt cache and
   the Q row on the action's evicted cache, both fed the same trunk U. At step s,
   p_s = P(·|U_<s), q_s = Q^a(·|U_<s) (EOS ids merged into one outcome,
   :func:`kvdiverge.theory.coupling.merge_eos`; every kernel here, of the scan and of the
   continuation, is softmax(logits / T) in float64 at the decoding temperature T > 0,
   :func:`kvdiverge.theory.coupling.tempered_kernel`, as the naive engine's),
   e_s = TV(p_s, q_s), and U_s ~ c_s/(1 − e_s) with c_s = min(p_s, q_s), by inverse CDF at
   the ``SWRB_SCAN`` stream. The residual candidates X°_s ~ (p_s − c_s)/e_s (``REFERENCE``)
   and Y°_s ~ (q_s − c_s)/e_s (``RESIDUAL``) are drawn
   at every scanned step from their own uniforms, so no law needs to be kept. A replicate's scan
   stops where e_s = 1 or U emits EOS (then e = 0 from there on, "End of sequence"). Step 1's
   laws are the prefill's, the same for P and Q (e_1 = 0). All scanning rows of all actions of
   the document decode in ONE model call per step.
2. Survival weights w_s = e_s Π_{r<s}(1 − e_r), M = Σ_s w_s = P(τ ≤ H | U); the entry time
   J ~ w/M by inverse CDF at the ``SWRB_ENTRY`` stream; the residual pair (X_J, Y_J) =
   (X°_J, Y°_J), so X_J ≠ Y_J.
3. The coupled continuation over J + 1..H: an X row on the full cache and a Y row on the
   evicted cache, each starting from its scan row's generated entries for U_<J (the P row's for
   X, the Q row's for Y) and fed its own token at J; the stepwise maximal coupling (accept
   sampler, streams ``REFERENCE``, ``ACCEPT``, ``RESIDUAL`` at steps J + 1..H). All rows of all
   replicates and actions decode in one model call per step: a row whose entry is J joins the
   batch at the call for step J + 1, so every row of a call holds the same number of entries.
   A side that has emitted EOS has the point mass on EOS as its law and runs no row.

Every uniform is keyed by (seed, document, replicate, step, stream) with the salt
:data:`SWRB_SALT`, so a rerun is bit-identical and a replicate's draws do not depend on the
batch. Cost, in model row-steps (one row through one decoding call): the scan pays two rows for
each evaluated step after the first (step 1 is the prefill's), the continuation one row per side
still outside EOS at each step J + 1..H; the residual pair reuses the scan's evaluation. The
naive coupled rollout of the same action alone pays its X and Y rows until their EOS over steps
2..H (fixed-history rows Z are not part of either estimator).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvdiverge.engine.attention import (
    ATTENTION_NAME,
    RowCache,
    SharedPrefix,
    attention_implementation,
)
from kvdiverge.engine.document import gather_prefix, mean_kept
from kvdiverge.engine.rows import decode_step
from kvdiverge.engine.settings import model_device
from kvdiverge.eviction import (
    ActionError,
    ActionSpec,
    Prefill,
    is_decoding,
    is_transform,
    parse_action,
    run_prefill,
    select_positions,
)
from kvdiverge.io.swrb_records import SwrbRollout
from kvdiverge.theory.coupling import (
    Stream,
    canonical_eos,
    crn_uniforms,
    document_key,
    inverse_cdf,
    maximal_coupling_step,
    merge_eos,
    tempered_kernel,
    tv,
)
from kvdiverge.theory.survival import survival_weights

__all__ = ["SWRB_SALT", "swrb_rollout_document", "swrb_temperature_problem"]

SWRB_SALT = 1
"""Salt of every SWRB uniform (the naive engine's are unsalted under ``shared-reference``)."""


def swrb_temperature_problem(temperature: Any) -> str | None:
    """Why SWRB cannot run at ``temperature``, in one phrase, or None for a finite T > 0.

    At T = 0 (greedy) the kernels are point masses: e_s ∈ {0, 1}, the trunk is the greedy path
    itself and M = 1{τ ≤ H}, so the scan has nothing to branch and no variance to remove; the
    shared-reference coupling covers greedy decoding (one path per document)."""
    t = temperature
    if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < float("inf"):
        return f"expected a finite number > 0, got {t!r}"
    if t == 0:
        return (
            "0 (greedy) is not run by SWRB: greedy kernels are point masses, so the SWRB trunk "
            "has nothing to branch; use coupling shared-reference, which covers greedy decoding"
        )
    return None


def _stream(seed: int, doc: int, reps: np.ndarray, steps: Any, stream: Stream) -> np.ndarray:
    return crn_uniforms(seed, doc, reps, steps, stream, SWRB_SALT)


def _copy_entries(target: RowCache, slots: torch.Tensor, source: RowCache, rows: torch.Tensor):
    """Rows ``slots`` of ``target`` get the first ``target.lengths`` entries of ``source``'s
    rows ``rows`` (the scan's entries for U_<J)."""
    for layer, length in enumerate(target.lengths):
        target.keys[layer][slots, :, :length] = source.keys[layer][rows, :, :length]
        target.values[layer][slots, :, :length] = source.values[layer][rows, :, :length]


def _new_cache(prefill: Prefill, rows: int, H: int) -> RowCache:
    n_kv, _, d = prefill.keys[0].shape
    device = prefill.keys[0].device
    return RowCache(len(prefill.keys), rows, n_kv, d, max(H - 1, 1), prefill.keys[0].dtype, device)


@torch.inference_mode()
def _scan(
    model: torch.nn.Module,
    prefill: Prefill,
    prompts: list[list[tuple[torch.Tensor, ...]]],
    chain_reps: np.ndarray,
    k: int,
    H: int,
    seed: int,
    doc: int,
    eos_ids: Sequence[int],
    fused: bool,
    temperature: float,
) -> dict[str, Any]:
    """The overlap scans of all chains (action-major, k per action) in one batch per step.

    Returns e, trunk, residual candidates x_res/y_res (n, H), steps evaluated, and the scan
    cache (P rows 0..n−1, Q rows n..2n−1 in chain order)."""
    n = chain_reps.size
    device = prefill.keys[0].device
    eos = torch.tensor(sorted({int(i) for i in eos_ids}), device=device)
    steps = np.arange(1, H + 1)[:, None]
    u_scan, u_ref, u_res = (
        torch.from_numpy(_stream(seed, doc, chain_reps[None, :], steps, s)).to(device)
        for s in (Stream.SWRB_SCAN, Stream.REFERENCE, Stream.RESIDUAL)
    )
    cache = _new_cache(prefill, 2 * n, H)
    full = list(zip(prefill.keys, prefill.values, strict=True))
    groups = [torch.arange(n, device=device)]
    groups += [n + a * k + torch.arange(k, device=device) for a in range(len(prompts))]
    shared = SharedPrefix(groups, [full, *prompts], fused)
    first = merge_eos(tempered_kernel(prefill.last_logits, temperature), eos_ids)
    p = q = first.expand(n, -1)
    e = torch.zeros((n, H), dtype=torch.float64, device=device)
    trunk = torch.full((n, H), -1, dtype=torch.long, device=device)
    x_res = torch.zeros((n, H), dtype=torch.long, device=device)
    y_res = torch.zeros((n, H), dtype=torch.long, device=device)
    evaluated = torch.zeros(n, dtype=torch.long, device=device)
    scanning = torch.ones(n, dtype=torch.bool, device=device)
    u_prev = None
    for t in range(1, H + 1):
        if t > 1:
            tokens = torch.cat([u_prev, u_prev])
            logits = decode_step(model, tokens, prefill.n + t - 2, cache, shared)
            probs = merge_eos(tempered_kernel(logits, temperature), eos_ids, inplace=True)
            p, q = probs[:n], probs[n:]
        evaluated += scanning
        c = torch.minimum(p, q)
        e_t = tv(p, q).clamp(0.0, 1.0)
        e[:, t - 1] = torch.where(scanning, e_t, 0.0)
        u_t = inverse_cdf(c, u_scan[t - 1])
        x_res[:, t - 1] = inverse_cdf((p - c).clamp(min=0), u_ref[t - 1])
        y_res[:, t - 1] = inverse_cdf((q - c).clamp(min=0), u_res[t - 1])
        alive = scanning & (e_t < 1.0)
        trunk[:, t - 1] = torch.where(alive, u_t, -1)
        scanning = alive & ~torch.isin(u_t, eos)
        u_prev = torch.where(alive, u_t, int(eos[0]))
        if not bool(scanning.any()):
            break
    return {
        "e": e.cpu().numpy(),
        "trunk": trunk.cpu().numpy(),
        "x_res": x_res.cpu().numpy(),
        "y_res": y_res.cpu().numpy(),
        "evaluated": evaluated.cpu().numpy(),
        "cache": cache,
    }


@torch.inference_mode()
def _continue(
    model: torch.nn.Module,
    prefill: Prefill,
    prompts: list[list[tuple[torch.Tensor, ...]]],
    chain_reps: np.ndarray,
    k: int,
    scan_cache: RowCache,
    x_tok: np.ndarray,
    y_tok: np.ndarray,
    entry: np.ndarray,
    seed: int,
    doc: int,
    eos_ids: Sequence[int],
    fused: bool,
    temperature: float,
) -> np.ndarray:
    """The coupled continuations J + 1..H of every branching chain, one model call per step.

    ``x_tok``/``y_tok`` (n, H) hold U_<J and the residual pair at J; they are filled in place
    over J + 1..H. Returns the continuation's row-steps per chain."""
    n, H = x_tok.shape
    device = prefill.keys[0].device
    eos_list = sorted({int(i) for i in eos_ids})
    eos_np = np.array(eos_list)
    end = canonical_eos(eos_ids)
    point_mass = torch.zeros(prefill.last_logits.shape[-1], dtype=torch.float64, device=device)
    point_mass[end] = 1.0
    full = list(zip(prefill.keys, prefill.values, strict=True))
    idx = np.arange(n)
    j_idx = np.clip(entry, 1, H) - 1
    branch = entry <= H
    x_done = branch & np.isin(x_tok[idx, j_idx], eos_np)
    y_done = branch & np.isin(y_tok[idx, j_idx], eos_np)
    cost = np.zeros(n, dtype=np.int64)
    cache = _new_cache(prefill, 2 * int(branch.sum()) or 1, H)
    cache.rows = 0
    row_chain = np.zeros(0, dtype=np.int64)
    row_side = np.zeros(0, dtype=np.int64)  # 0: X on the full cache, 1: Y on the evicted cache
    n_groups = 1 + len(prompts)
    for t in range(2, H + 1):
        after = branch & (entry < t)
        x_tok[after, t - 1] = end  # overwritten below wherever a side still runs
        y_tok[after, t - 1] = end
        if cache.rows == 0:
            cache.lengths = [t - 2] * len(cache.lengths)
        joining = np.flatnonzero(branch & (entry == t - 1))
        new_chain = np.concatenate([joining[~x_done[joining]], joining[~y_done[joining]]])
        new_side = np.concatenate(
            [
                np.zeros((~x_done[joining]).sum(), np.int64),
                np.ones((~y_done[joining]).sum(), np.int64),
            ]
        )
        if new_chain.size:
            slots = torch.arange(cache.rows, cache.rows + new_chain.size, device=device)
            source = torch.from_numpy(new_chain + n * new_side).to(device)
            _copy_entries(cache, slots, scan_cache, source)
            cache.rows += new_chain.size
            row_chain = np.concatenate([row_chain, new_chain])
            row_side = np.concatenate([row_side, new_side])
        running = np.where(row_side == 0, ~x_done[row_chain], ~y_done[row_chain])
        if running.size and 4 * (~running).sum() >= running.size:
            keep = np.flatnonzero(running)
            cache.keep_rows(torch.from_numpy(keep).to(device))
            row_chain, row_side = row_chain[keep], row_side[keep]
        active = np.flatnonzero(after & ~(x_done & y_done))
        if active.size == 0:  # no side runs: the rows leave (later ones join at their length)
            cache.rows = 0
            row_chain, row_side = row_chain[:0], row_side[:0]
            continue
        np.add.at(
            cost, row_chain[np.where(row_side == 0, ~x_done[row_chain], ~y_done[row_chain])], 1
        )
        group = np.where(row_side == 0, 0, 1 + row_chain // k)
        rows = [torch.from_numpy(np.flatnonzero(group == g)).to(device) for g in range(n_groups)]
        shared = SharedPrefix(rows, [full, *prompts], fused)
        fed = np.where(row_side == 0, x_tok[row_chain, t - 2], y_tok[row_chain, t - 2])
        tokens = torch.from_numpy(fed).to(device)
        logits = decode_step(model, tokens, prefill.n + t - 2, cache, shared)
        probs = merge_eos(tempered_kernel(logits, temperature), eos_ids, inplace=True)
        p = point_mass.expand(n, -1).clone()
        q = p.clone()
        rc = torch.from_numpy(row_chain).to(device)
        is_x = torch.from_numpy(row_side == 0).to(device)
        p[rc[is_x]] = probs[is_x]
        q[rc[~is_x]] = probs[~is_x]
        # a side that has ended keeps the point mass (its row, if still in the batch, is ignored)
        p[torch.from_numpy(x_done).to(device)] = point_mass
        q[torch.from_numpy(y_done).to(device)] = point_mass
        sel = torch.from_numpy(active).to(device)
        u = np.stack(
            [
                _stream(seed, doc, chain_reps[active], t, s)
                for s in (Stream.REFERENCE, Stream.ACCEPT, Stream.RESIDUAL)
            ],
            axis=-1,
        )
        x, y = maximal_coupling_step(p[sel], q[sel], torch.from_numpy(u).to(device))
        x, y = x.cpu().numpy(), y.cpu().numpy()
        x_tok[active, t - 1] = x
        y_tok[active, t - 1] = y
        x_done[active] |= np.isin(x, eos_np)
        y_done[active] |= np.isin(y, eos_np)
    return cost


def swrb_rollout_document(
    model: torch.nn.Module,
    input_ids: Sequence[int] | torch.Tensor,
    actions: Sequence[ActionSpec | Mapping[str, Any]],
    doc_id: str,
    replicates: int | Sequence[int],
    eos_ids: Sequence[int],
    H: int,
    seed: int,
    fused_attention: bool = True,
    prefill: Prefill | None = None,
    temperature: float = 1.0,
) -> dict[str, SwrbRollout]:
    """SWRB replicates of one document under several actions (module docstring).

    One prefill serves every action; each action's kept entries are gathered from it once. The
    scans of all actions and replicates decode as one batch, then their continuations as
    another. ``replicates``: K or explicit replicate indices; ``temperature``: T > 0, the
    kernels P and Q are softmax(logits / T) (T = 1, the default: the model's own law, bit for
    bit the untempered kernel). Returns ``{action: SwrbRollout}``.
    """
    if isinstance(H, bool) or not isinstance(H, int | np.integer) or H < 1:
        raise ValueError(f"H: expected an integer >= 1, got {H!r}")
    problem = swrb_temperature_problem(temperature)
    if problem:
        raise ValueError(f"temperature: {problem}")
    if not eos_ids:
        raise ValueError("eos_ids: at least one EOS token id is needed")
    specs = [a if isinstance(a, ActionSpec) else parse_action(a) for a in actions]
    for a in specs:  # SWRB gathers kept subsets of the prompt: no other cache is its Q
        if is_transform(a) or is_decoding(a):
            kind = (
                "transforms the prompt cache" if is_transform(a) else "compresses during decoding"
            )
            raise ActionError(
                f"action {a.name!r}: selector {a.selector!r} {kind}; SWRB runs prompt selections "
                "only (a kept subset of the prompt's entries): estimate it with the coupled rollout"
            )
    reps = np.arange(replicates) if isinstance(replicates, int) else np.asarray(replicates)
    reps = reps.astype(np.int64)
    k = reps.size
    if prefill is None:
        prefill = run_prefill(model, input_ids, actions=specs)
    kept = [select_positions(prefill, a) for a in specs]
    prompts = [gather_prefix(prefill, positions) for positions in kept]
    chain_reps = np.tile(reps, len(specs))
    doc = document_key(doc_id)
    end = canonical_eos(eos_ids)
    assert model_device(model) == prefill.keys[0].device
    with attention_implementation(model, ATTENTION_NAME):
        scan = _scan(
            model, prefill, prompts, chain_reps, k, H, seed, doc, eos_ids, fused_attention,
            temperature,
        )  # fmt: skip
        w, M = survival_weights(scan["e"])
        n = chain_reps.size
        u_entry = _stream(seed, doc, chain_reps, 0, Stream.SWRB_ENTRY)
        entry = np.where(M > 0, inverse_cdf(w, u_entry) + 1, H + 1)
        base = np.where(scan["trunk"] >= 0, scan["trunk"], end)
        x_tok, y_tok = base.copy(), base.copy()
        has = entry <= H
        idx = np.arange(n)[has]
        j = entry[has] - 1
        x_tok[idx, j] = scan["x_res"][idx, j]
        y_tok[idx, j] = scan["y_res"][idx, j]
        cont = _continue(
            model,
            prefill,
            prompts,
            chain_reps,
            k,
            scan["cache"],
            x_tok,
            y_tok,
            entry,
            seed,
            doc,
            eos_ids,
            fused_attention,
            temperature,
        )
    out = {}
    for a, spec in enumerate(specs):
        part = slice(a * k, (a + 1) * k)
        out[spec.name] = SwrbRollout(
            doc_id=doc_id,
            action=spec.name,
            replicates=reps,
            e=scan["e"][part],
            trunk=scan["trunk"][part],
            weight=M[part],
            entry=entry[part],
            x_token=x_tok[part],
            y_token=y_tok[part],
            scan_steps=scan["evaluated"][part],
            cost_scan=2 * np.maximum(scan["evaluated"][part] - 1, 0),
            cost_continuation=cont[part],
            n_prompt=prefill.n,
            n_kept=mean_kept(kept[a]),
        )
    return out
