"""Total variation, the maximal-coupling step and common random numbers.

Documented in `docs/method.md`, "The coupled pair", "End of sequence" and "Common random numbers".

Everything here is vectorized over rows: ``p`` and ``q`` are ``(..., V)`` arrays of
probabilities (numpy arrays or torch tensors; the result has the same kind).
"""

from __future__ import annotations

import hashlib
from enum import IntEnum
from typing import Any

import numpy as np

__all__ = [
    "Stream",
    "canonical_eos",
    "crn_uniforms",
    "document_key",
    "inverse_cdf",
    "maximal_coupling_joint",
    "maximal_coupling_step",
    "merge_eos",
    "tempered_kernel",
    "tv",
]


class Stream(IntEnum):
    """Named random-number streams: each draw of a step has its own stream."""

    REFERENCE = 0  # X_t by inverse CDF: shared by every action of a document
    ACCEPT = 1  # accept Y = X with probability min(1, q(X)/p(X))
    RESIDUAL = 2  # Y from (q - p)+ / e after a rejection
    OVERLAP = 3  # the overlap sampler's coupled / uncoupled branch choice
    SWRB_ENTRY = 4  # SWRB entry time J
    SWRB_SCAN = 5  # SWRB overlap scan U_s
    FIXED = 6  # fixed-history stream Z (teacher forcing), when it must be sampled


def _is_torch(a: Any) -> bool:
    return type(a).__module__.startswith("torch")


def tv(p: Any, q: Any) -> Any:
    """TV(p, q) = 1/2 Σ_u |p(u) − q(u)| along the last axis (torch: |·| in place on p − q)."""
    d = p - q
    return 0.5 * (d.abs_() if _is_torch(d) else abs(d)).sum(-1)


def tempered_kernel(logits: Any, temperature: float = 1.0) -> Any:
    """The sampling kernel softmax(logits / T) along the last axis, in float64 (torch or numpy).

    T = 1 is ``softmax(logits)`` itself (no division, bit for bit the untempered kernel); T = 0
    is greedy decoding: the point mass on the argmax, ties broken by the smallest id.
    """
    if temperature < 0:
        raise ValueError(f"temperature: expected a number >= 0, got {temperature!r}")
    if _is_torch(logits):
        if temperature == 0:
            import torch

            out = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
            return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)  # first maximum
        z = logits.double()
        return (z if temperature == 1 else z / temperature).softmax(dim=-1)
    z = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        out = np.zeros(z.shape)
        np.put_along_axis(out, z.argmax(-1)[..., None], 1.0, axis=-1)  # first maximum
        return out
    z = z if temperature == 1 else z / temperature
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def canonical_eos(eos_ids: Any) -> int:
    """The index that stands for the one EOS outcome: the smallest EOS id.

    Taking the smallest (not the first listed) makes every result invariant to the order in
    which a model's generation config lists its EOS ids.
    """
    ids = [int(i) for i in eos_ids]
    if not ids:
        raise ValueError("eos_ids: at least one EOS token id is needed")
    return min(ids)


def merge_eos(kernel: Any, eos_ids: Any, inplace: bool = False) -> Any:
    """The kernel with all EOS ids merged into one outcome, along the last axis.

    A model with several end-of-sequence ids (Llama-3.1 lists three) ends a sequence with any
    of them, and two sequences that both end have not disagreed: the end is ONE outcome of the
    next-token law (``docs/method.md``, "End of sequence"). The merged kernel puts
    Σ_{e ∈ eos_ids} kernel(e) on :func:`canonical_eos` and 0 on the other EOS ids; TV, the
    coupling and the EOS flags are all computed on merged kernels. With a single EOS id the
    kernel is returned unchanged (the same object). Works for numpy arrays and torch tensors;
    ``inplace`` (torch only) overwrites ``kernel`` instead of a copy.
    """
    ids = sorted({int(i) for i in eos_ids})
    if len(ids) < 2:
        return kernel
    canon, others = ids[0], ids[1:]
    if _is_torch(kernel):
        import torch

        index = torch.tensor(ids, device=kernel.device)
        mass = kernel.index_select(-1, index).sum(-1)
        out = kernel if inplace else kernel.clone()
        out[..., others] = 0
        out[..., canon] = mass
        return out
    out = np.array(kernel, dtype=np.float64, copy=True)
    mass = out[..., ids].sum(-1)
    out[..., others] = 0
    out[..., canon] = mass
    return out


_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer, elementwise on uint64 (wraps modulo 2**64)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def document_key(doc_id: str) -> int:
    """A stable 63-bit integer key for a document id (independent of Python's hash seed)."""
    return int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8).digest(), "little") >> 1


def crn_uniforms(
    seed: int,
    document: int | str,
    replicate: Any,
    step: Any,
    stream: int | Stream,
    salt: int = 0,
) -> np.ndarray:
    """Common random numbers: one uniform in [0, 1) per (seed, document, replicate, step, stream).

    The reference token X_t is drawn by inverse CDF from a uniform that depends only on (seed,
    document, replicate, t); the coupling's accept and residual draws use separate streams.
    The value is a counter-based hash (SplitMix64 chained over the key), so any subset of draws
    can be generated in any order and batch shape and always gives the same numbers.
    ``replicate`` and ``step`` broadcast against each other; ``salt`` separates further families
    (e.g. an action index for independent references).
    """
    doc = document_key(document) if isinstance(document, str) else int(document)
    rep = np.asarray(replicate, dtype=np.int64).astype(np.uint64)
    st = np.asarray(step, dtype=np.int64).astype(np.uint64)
    rep, st = np.broadcast_arrays(rep, st)
    h = _splitmix64(np.full(rep.shape, np.uint64(int(seed) & 0xFFFFFFFFFFFFFFFF)))
    for part in (np.uint64(doc & 0xFFFFFFFFFFFFFFFF), np.uint64(int(stream)), np.uint64(salt)):
        h = _splitmix64(h ^ part)
    h = _splitmix64(h ^ rep)
    h = _splitmix64(h ^ st)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


def inverse_cdf(weights: Any, u: Any) -> Any:
    """Index drawn from unnormalized ``weights`` (…, V) by inverse CDF at uniforms ``u`` (…).

    Returns the first index whose cumulative weight exceeds ``u · Σ weights``; never an index of
    zero weight (floating-point overshoot falls back to the last index with positive weight).
    Rows whose weights are all zero return index 0.
    """
    if _is_torch(weights):
        import torch

        cdf = torch.cumsum(weights, dim=-1)
        target = (u.to(cdf.dtype) * cdf[..., -1]).unsqueeze(-1)
        idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)
        v = weights.shape[-1]
        overshoot = idx >= v
        if not bool(overshoot.any()):  # the rare fallback below is computed only when needed
            return idx
        positions = torch.arange(v, device=weights.device)
        last_pos = torch.where(weights > 0, positions, -1).amax(-1).clamp(min=0)
        return torch.where(overshoot, last_pos, idx)
    w = np.asarray(weights, dtype=np.float64)
    cdf = np.cumsum(w, axis=-1)
    target = np.asarray(u, dtype=np.float64) * cdf[..., -1]
    idx = (cdf <= target[..., None]).sum(-1)
    v = w.shape[-1]
    last_pos = np.where(w > 0, np.arange(v), -1).max(-1).clip(min=0)
    return np.where(idx >= v, last_pos, idx)


def _take(a: Any, idx: Any) -> Any:
    if _is_torch(a):
        return a.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    return np.take_along_axis(a, idx[..., None], axis=-1)[..., 0]


def maximal_coupling_step(
    p: Any, q: Any, u: Any, sampler: str = "accept", x: Any = None
) -> tuple[Any, Any]:
    """One step of the maximal coupling of p and q, vectorized over rows.

    ``u`` holds three independent uniforms per row, shape ``(..., 3)``. ``x`` (``accept``
    only): X already drawn from p at ``u[..., 0]`` (``inverse_cdf(p, u[..., 0])``), e.g. once
    for several q against the same p; the result is the same as without it.

    * ``sampler="accept"`` (the default; `docs/method.md`, "Common random numbers"): X ~ p by
      inverse CDF at ``u[..., 0]``; Y = X if ``u[..., 1] · p(X) < q(X)`` (probability
      min(1, q(X)/p(X))), else Y ~ (q − p)+ / e by inverse CDF at ``u[..., 2]``.
    * ``sampler="overlap"``: with probability 1 − e (``u[..., 0] < 1 − e``) draw one token from
      c / (1 − e), c = min(p, q), at ``u[..., 1]`` and set X = Y; otherwise X ~ (p − c)/e at
      ``u[..., 1]`` and Y ~ (q − c)/e at ``u[..., 2]``.

    Both samplers have the same joint law: marginals p and q and P(X ≠ Y) = TV(p, q).
    Returns integer index arrays ``(x, y)`` of shape ``p.shape[:-1]``.
    """
    if sampler not in ("accept", "overlap"):
        raise ValueError(f"sampler: expected 'accept' or 'overlap', got {sampler!r}")
    torch_mode = _is_torch(p)
    if torch_mode:
        import torch

        u = torch.as_tensor(u, device=p.device)
        clip0 = lambda a: a.clamp(min=0)  # noqa: E731
        minimum = torch.minimum
        where = torch.where
    else:
        p = np.asarray(p, dtype=np.float64)
        q = np.asarray(q, dtype=np.float64)
        u = np.asarray(u, dtype=np.float64)
        clip0 = lambda a: np.clip(a, 0, None)  # noqa: E731
        minimum = np.minimum
        where = np.where
    u0, u1, u2 = u[..., 0], u[..., 1], u[..., 2]
    if sampler == "accept":
        x = inverse_cdf(p, u0) if x is None else x
        px, qx = _take(p, x), _take(q, x)
        accept = u1.to(px.dtype) * px < qx if torch_mode else u1 * px < qx
        if torch_mode and p.dim() == 2:  # the residual only in the rows that reject X
            rows = (~accept).nonzero()[:, 0]
            y = x.clone()
            if rows.numel():
                residual = (q[rows] - p[rows]).clamp_(min=0)  # in place: a fresh difference
                y_res = inverse_cdf(residual, u2[rows])
                y[rows] = where(residual.sum(-1) > 0, y_res, x[rows])
            return x, y
        residual = clip0(q - p)
        has_residual = residual.sum(-1) > 0
        y_res = inverse_cdf(residual, u2)
        y = where(accept | ~has_residual, x, y_res)
        return x, y
    c = minimum(p, q)
    overlap = c.sum(-1)
    e = clip0(1 - overlap)
    coupled = (u0.to(e.dtype) if torch_mode else u0) < 1 - e
    z = inverse_cdf(c, u1)
    x_res = inverse_cdf(clip0(p - c), u1)
    y_res = inverse_cdf(clip0(q - c), u2)
    pres = clip0(p - c).sum(-1) > 0
    qres = clip0(q - c).sum(-1) > 0
    x = where(coupled | ~pres, z, x_res)
    y = where(coupled | ~qres, z, y_res)
    return x, y


def maximal_coupling_joint(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Exact joint law (V × V matrix) of the maximal coupling of two distributions.

    J[u, u] = min(p(u), q(u)); off the diagonal J[x, y] = (p − c)(x) (q − c)(y) / e.
    """
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    c = np.minimum(p, q)
    e = 1.0 - c.sum()
    joint = np.diag(c)
    if e > 0:
        joint = joint + np.outer(p - c, q - c) / e
    return joint
