"""kvdiverge.theory.coupling: exact joint law of both samplers, sampling, CRN streams."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from kvdiverge.theory.coupling import (
    Stream,
    canonical_eos,
    crn_uniforms,
    document_key,
    inverse_cdf,
    maximal_coupling_joint,
    maximal_coupling_step,
    merge_eos,
    tv,
)

DENOMINATOR = 6  # test laws have probabilities k/6: every cell boundary of u is a multiple of 1/60
GRID = (12, 120, 120)  # midpoint grid over (u0, u1, u2): no midpoint lies on a boundary


def sixths(rng: np.random.Generator, vocab: int) -> np.ndarray:
    """A random law on ``vocab`` tokens with probabilities in {0, 1/6, …, 1}."""
    cuts = np.sort(rng.integers(0, DENOMINATOR + 1, size=vocab - 1))
    return np.diff(np.concatenate([[0], cuts, [DENOMINATOR]])) / DENOMINATOR


LAW_PAIRS = [
    (np.array([3, 2, 1, 0]) / 6, np.array([0, 1, 2, 3]) / 6),
    (np.array([1, 1, 1, 3]) / 6, np.array([1, 1, 1, 3]) / 6),  # identical: TV 0
    (np.array([6, 0, 0, 0]) / 6, np.array([0, 0, 3, 3]) / 6),  # disjoint: TV 1
    *[
        (sixths(np.random.default_rng(k), 4), sixths(np.random.default_rng(k + 50), 4))
        for k in range(6)
    ],
]


def grid_uniforms() -> np.ndarray:
    """All midpoints of the (u0, u1, u2) grid, shape (n, 3)."""
    axes = [(np.arange(n) + 0.5) / n for n in GRID]
    return np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 3)


def grid_joint(p: np.ndarray, q: np.ndarray, sampler: str, backend: str) -> np.ndarray:
    """Joint law of (X, Y) integrated over the u grid: exact for laws with probabilities k/6."""
    u = grid_uniforms()
    n, vocab = len(u), len(p)
    if backend == "numpy":
        x, y = maximal_coupling_step(np.tile(p, (n, 1)), np.tile(q, (n, 1)), u, sampler)
    else:
        dtype = torch.float64 if backend == "torch64" else torch.float32
        pt = torch.tensor(p, dtype=dtype).expand(n, vocab)
        qt = torch.tensor(q, dtype=dtype).expand(n, vocab)
        x, y = maximal_coupling_step(pt, qt, torch.tensor(u), sampler)
        x, y = x.numpy(), y.numpy()
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (x, y), 1.0)
    return counts / n


# ----------------------------------------------------------------------------------------------
# Exact joint law
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "q"), LAW_PAIRS)
def test_maximal_coupling_joint_is_a_maximal_coupling(p, q):
    joint = maximal_coupling_joint(p, q)
    assert (joint >= 0).all()
    np.testing.assert_allclose(joint.sum(1), p, atol=1e-15)
    np.testing.assert_allclose(joint.sum(0), q, atol=1e-15)
    assert 1 - np.trace(joint) == pytest.approx(float(tv(p, q)), abs=1e-15)
    # Off-diagonal mass of a maximal coupling avoids the overlap: X ≠ Y only on disjoint residuals.
    off = joint - np.diag(np.diag(joint))
    np.testing.assert_allclose(np.diag(joint), np.minimum(p, q), atol=1e-15)
    assert (off.sum(1) <= np.clip(p - q, 0, None) + 1e-15).all()


@pytest.mark.parametrize("backend", ["numpy", "torch64", "torch32"])
@pytest.mark.parametrize("sampler", ["accept", "overlap"])
@pytest.mark.parametrize(("p", "q"), LAW_PAIRS)
def test_sampler_joint_law_is_exact(p, q, sampler, backend):
    joint = grid_joint(p, q, sampler, backend)
    np.testing.assert_allclose(joint, maximal_coupling_joint(p, q), atol=1e-12)
    np.testing.assert_allclose(joint.sum(1), p, atol=1e-12)
    np.testing.assert_allclose(joint.sum(0), q, atol=1e-12)
    assert 1 - np.trace(joint) == pytest.approx(float(tv(p, q)), abs=1e-12)


# ----------------------------------------------------------------------------------------------
# Sampled frequencies
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("sampler", ["accept", "overlap"])
@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_frequencies_chi_square(seed, sampler, backend):
    rng = np.random.default_rng(seed)
    vocab, n = 5, 40_000
    p = rng.dirichlet(np.ones(vocab))
    q = rng.dirichlet(np.ones(vocab))
    q[rng.integers(vocab)] = 0.0  # a token the intervention never emits
    q /= q.sum()
    u = rng.random((n, 3))
    if backend == "numpy":
        x, y = maximal_coupling_step(np.tile(p, (n, 1)), np.tile(q, (n, 1)), u, sampler)
    else:
        x, y = maximal_coupling_step(
            torch.tensor(p).expand(n, vocab),
            torch.tensor(q).expand(n, vocab),
            torch.tensor(u),
            sampler,
        )
        x, y = x.numpy(), y.numpy()
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (x, y), 1)
    expected = maximal_coupling_joint(p, q) * n
    support = expected > 0
    assert counts[~support].sum() == 0
    result = stats.chisquare(counts[support], expected[support])
    assert result.pvalue > 1e-3


def test_row_batches_with_different_laws():
    """Vectorized over rows: each row follows its own pair of laws."""
    rng = np.random.default_rng(7)
    vocab, rows, n = 3, 4, 20_000
    p = rng.dirichlet(np.ones(vocab), size=rows)
    q = rng.dirichlet(np.ones(vocab), size=rows)
    u = rng.random((n, rows, 3))
    x, y = maximal_coupling_step(
        np.broadcast_to(p, (n, rows, vocab)), np.broadcast_to(q, (n, rows, vocab)), u
    )
    assert x.shape == (n, rows)
    for r in range(rows):
        counts = np.zeros((vocab, vocab))
        np.add.at(counts, (x[:, r], y[:, r]), 1)
        expected = maximal_coupling_joint(p[r], q[r]) * n
        support = expected > 0
        assert counts[~support].sum() == 0
        assert stats.chisquare(counts[support], expected[support]).pvalue > 1e-3


def test_inverse_cdf_never_returns_zero_weight():
    weights = np.array([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    u = np.array([[0.0, 0.0], [0.4999, 0.3], [0.5, 0.9], [np.nextafter(1.0, 0), 0.99]])
    for row in u:
        idx = inverse_cdf(weights, row)
        assert idx[0] in (1, 3) and idx[1] == 0
        t_idx = inverse_cdf(torch.tensor(weights), torch.tensor(row))
        np.testing.assert_array_equal(t_idx.numpy(), idx)
    assert inverse_cdf(weights[0], 0.5) == 3


def test_invalid_sampler():
    with pytest.raises(ValueError, match="sampler: expected 'accept' or 'overlap'"):
        maximal_coupling_step(np.ones(2) / 2, np.ones(2) / 2, np.zeros(3), sampler="gumbel")


# ----------------------------------------------------------------------------------------------
# Common random numbers
# ----------------------------------------------------------------------------------------------


def test_crn_deterministic_and_in_range():
    reps, steps = np.arange(64)[:, None], np.arange(1, 129)[None, :]
    a = crn_uniforms(7, "ruler-4k/study1/003", reps, steps, Stream.REFERENCE)
    b = crn_uniforms(7, "ruler-4k/study1/003", reps, steps, Stream.REFERENCE)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (64, 128) and a.dtype == np.float64
    assert a.min() >= 0.0 and a.max() < 1.0
    assert document_key("ruler-4k/study1/003") == document_key("ruler-4k/study1/003")
    np.testing.assert_array_equal(
        a, crn_uniforms(7, document_key("ruler-4k/study1/003"), reps, steps, Stream.REFERENCE)
    )


def test_crn_order_and_shape_invariance():
    reps, steps = np.arange(16), np.arange(1, 33)
    grid = crn_uniforms(3, 11, reps[:, None], steps[None, :], Stream.ACCEPT)
    rng = np.random.default_rng(0)
    pairs = np.array(list(itertools.product(reps, steps)))
    order = rng.permutation(len(pairs))
    flat = crn_uniforms(3, 11, pairs[order, 0], pairs[order, 1], Stream.ACCEPT)
    np.testing.assert_array_equal(flat, grid[pairs[order, 0], pairs[order, 1] - 1])
    for r, t in pairs[order[:20]]:
        assert crn_uniforms(3, 11, int(r), int(t), Stream.ACCEPT) == grid[r, t - 1]
    # A subset computed alone equals the same entries of a larger batch.
    np.testing.assert_array_equal(crn_uniforms(3, 11, 5, steps, Stream.ACCEPT), grid[5])


def test_crn_uniformity():
    reps, steps = np.arange(200)[:, None], np.arange(1, 101)[None, :]
    for stream in Stream:
        u = crn_uniforms(1, "doc", reps, steps, stream).ravel()
        assert stats.kstest(u, "uniform").pvalue > 1e-3, stream


def test_crn_streams_and_keys_are_uncorrelated():
    reps, steps = np.arange(100)[:, None], np.arange(1, 201)[None, :]
    n = 100 * 200
    bound = 4 / np.sqrt(n)
    base = crn_uniforms(5, "doc-a", reps, steps, Stream.REFERENCE).ravel()
    variants = {
        f"stream {s.name}": crn_uniforms(5, "doc-a", reps, steps, s).ravel()
        for s in Stream
        if s is not Stream.REFERENCE
    }
    variants["other document"] = crn_uniforms(5, "doc-b", reps, steps, Stream.REFERENCE).ravel()
    variants["other seed"] = crn_uniforms(6, "doc-a", reps, steps, Stream.REFERENCE).ravel()
    variants["other salt"] = crn_uniforms(5, "doc-a", reps, steps, Stream.REFERENCE, salt=1).ravel()
    variants["next step"] = crn_uniforms(5, "doc-a", reps, steps + 1, Stream.REFERENCE).ravel()
    variants["next replicate"] = crn_uniforms(5, "doc-a", reps + 1, steps, Stream.REFERENCE).ravel()
    for name, other in variants.items():
        assert not np.array_equal(other, base), name
        assert abs(np.corrcoef(base, other)[0, 1]) < bound, name
    # Pairwise among the coupling's own streams too.
    accept, residual = variants["stream ACCEPT"], variants["stream RESIDUAL"]
    assert abs(np.corrcoef(accept, residual)[0, 1]) < bound


def test_merge_eos_sums_every_eos_id_onto_the_smallest():
    kernel = np.array([[0.1, 0.2, 0.3, 0.15, 0.25], [0.0, 0.5, 0.0, 0.5, 0.0]])
    merged = merge_eos(kernel, [3, 1])
    assert canonical_eos([3, 1]) == 1
    assert np.array_equal(
        merged, np.array([[0.1, 0.35, 0.3, 0.0, 0.25], [0.0, 1.0, 0.0, 0.0, 0.0]])
    )
    assert np.array_equal(merge_eos(kernel, [1, 3]), merged)  # order of the ids is irrelevant
    assert merge_eos(kernel, [3]) is kernel  # one id: unchanged
    torch_merged = merge_eos(torch.tensor(kernel), [3, 1])
    assert np.array_equal(torch_merged.numpy(), merged)
    inplace = torch.tensor(kernel)
    assert merge_eos(inplace, (1, 3), inplace=True) is inplace
    assert np.array_equal(inplace.numpy(), merged)


@pytest.mark.parametrize("sampler", ["accept", "overlap"])
def test_coupling_with_two_eos_ids_has_the_merged_joint_law(sampler):
    """The coupling of merged kernels, sampled, against the exact joint law of the maximal
    coupling over the outcomes {0, 2, 3, 5, EOS} written out here by hand."""
    rng = np.random.default_rng(7)
    p, q = rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))
    eos = [4, 1]
    outcomes = [0, 2, 3, 5]  # and EOS, recorded as id 1

    def law(d):
        return np.array([d[0], d[2], d[3], d[5], d[1] + d[4]])

    pm, qm = law(p), law(q)
    overlap = np.minimum(pm, qm)
    e = 1.0 - overlap.sum()
    exact = np.diag(overlap) + np.outer(pm - overlap, qm - overlap) / e
    n = 400_000
    u = np.stack([crn_uniforms(11, "eos-law", np.arange(n), 1, s) for s in (0, 1, 2)], axis=-1)
    x, y = maximal_coupling_step(
        merge_eos(np.tile(p, (n, 1)), eos), merge_eos(np.tile(q, (n, 1)), eos), u, sampler
    )
    assert not np.isin(x, [4]).any() and not np.isin(y, [4]).any()
    index = {token: i for i, token in enumerate(outcomes)} | {1: 4}
    counts = np.zeros((5, 5))
    np.add.at(counts, ([index[int(a)] for a in x], [index[int(b)] for b in y]), 1)
    bound = 5 * np.sqrt(exact * (1 - exact) / n) + 1e-12
    assert np.all(np.abs(counts / n - exact) <= bound)
    # both sequences end together with probability min(p(EOS), q(EOS))
    assert abs(counts[4, 4] / n - min(pm[4], qm[4])) <= bound[4, 4]


def test_accept_sampler_residual_in_rejecting_rows_only_and_shared_x_change_no_bit():
    """The torch ``accept`` sampler draws Y from the residual only in the rows that reject X,
    and takes X drawn beforehand: both give bit for bit what the full formula gives (X by
    inverse CDF of p; Y = X on acceptance or an empty residual, else the residual's inverse CDF
    over every row), here written out independently on rows that accept, reject, or have p = q."""
    gen = torch.Generator().manual_seed(5)
    rows, vocab = 64, 3001
    p = torch.rand(rows, vocab, generator=gen, dtype=torch.float64) ** 4
    p /= p.sum(-1, keepdim=True)
    q = p.clone()
    noisy = torch.arange(rows) % 3 != 0  # every third row: q = p (accepts, empty residual)
    q[noisy] = q[noisy] * torch.exp(torch.randn(int(noisy.sum()), vocab, generator=gen) * 0.5)
    q /= q.sum(-1, keepdim=True)
    u = torch.rand(rows, 3, generator=gen, dtype=torch.float64)

    x_ref = inverse_cdf(p, u[:, 0])
    px, qx = p.gather(-1, x_ref[:, None])[:, 0], q.gather(-1, x_ref[:, None])[:, 0]
    accept = u[:, 1] * px < qx
    residual = (q - p).clamp(min=0)
    y_ref = torch.where(accept | ~(residual.sum(-1) > 0), x_ref, inverse_cdf(residual, u[:, 2]))
    assert 0 < int((~accept).sum()) < rows  # both kinds of rows occur

    x, y = maximal_coupling_step(p, q, u)
    assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    x2, y2 = maximal_coupling_step(p, q, u, x=x_ref)
    assert torch.equal(x2, x_ref) and torch.equal(y2, y_ref)
