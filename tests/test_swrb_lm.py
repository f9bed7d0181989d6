"""SWRB for language-model rollouts (kvdiverge.swrb_rollout) against exact enumerated answers.

A tiny causal LM (random weights, 5 tokens of which 4 is EOS, a 40-token prompt, H = 4) with an
evicting action: every next-token law P(·|h) (full cache) and Q(·|h) (evicted cache) is computed
by plain transformers forwards over a cache of the kept prompt entries, for every history h, and
the coupled pair's exact R_SMC, O_H, Π_H and first-divergence law p_s are enumerated from the
maximal-coupling joint laws, independently of the engine and of the code under test.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvdiverge.engine import RolloutSettings, rollout_document
from kvdiverge.eviction import kept_positions
from kvdiverge.swrb_rollout import survival_weights, swrb_rollout_document

V, EOS, H = 5, 4, 4
ACTION = {"name": "recent-32", "selector": "recent", "budget": 32}
N_REP = 3000
SEED = 11


@pytest.fixture(scope="module")
def setup():
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0, 0.8 if name.startswith("lm_head") else 0.3)
    ids = torch.randint(0, EOS, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    laws = {}
    for name, selector in (("p", {"name": "f", "selector": "full"}), ("q", ACTION)):
        first, after = next_token_laws(model, ids, kept_positions(model, ids, selector))
        laws[name, ()] = first
        for leaf, probs in zip(itertools.product(range(V), repeat=H - 1), after, strict=True):
            for j in range(H - 1):
                laws[name, leaf[: j + 1]] = probs[j]
    return model, ids, laws


@torch.no_grad()
def next_token_laws(model, ids, kept) -> tuple[np.ndarray, np.ndarray]:
    """Plain transformers forwards: the law after the prompt, and (V^(H−1), H − 1, V) the laws
    after every prefix of every history of H − 1 tokens, fed at positions n.. over a
    DynamicCache holding the kept prompt entries of every layer and KV head."""
    n = len(ids)
    out = model(torch.tensor([ids]), use_cache=True)
    leaves = torch.tensor(list(itertools.product(range(V), repeat=H - 1)))
    batch = leaves.shape[0]
    cache = DynamicCache()
    for layer, entry in enumerate(out.past_key_values.layers):
        index = kept[layer][None, :, :, None].expand(-1, -1, -1, entry.keys.shape[-1])
        keys, values = (
            part.gather(2, index).expand(batch, -1, -1, -1).contiguous()
            for part in (entry.keys, entry.values)
        )
        cache.update(keys, values, layer)
    position = torch.arange(n, n + H - 1)[None].expand(batch, -1)
    logits = model(input_ids=leaves, position_ids=position, past_key_values=cache).logits
    first = out.logits[0, -1].double().softmax(-1).numpy()
    return first, logits.double().softmax(-1).numpy()


def kernel(laws, side: str, history: tuple[int, ...]) -> np.ndarray:
    """The exact next-token law after ``history``; the point mass on EOS once it has ended."""
    if EOS in history:
        return np.eye(V)[EOS]
    return laws[side, history]


def coupling_joint(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Maximal coupling: min(p, q) on the diagonal, (p − c) ⊗ (q − c)/e off it."""
    c = np.minimum(p, q)
    e = 1.0 - c.sum()
    joint = np.diag(c)
    if e > 1e-15:
        joint = joint + np.outer(p - c, q - c) / e
    return joint


@pytest.fixture(scope="module")
def exact(setup):
    """Exact E[I_t], p_s = P(τ = s), R_SMC, O_H and Π_H by enumerating the coupled paths."""
    _, _, laws = setup
    states = {((), (), H + 1): 1.0}  # (x history, y history, τ) → probability
    mismatch = np.zeros(H)
    for t in range(1, H + 1):
        nxt: dict = {}
        for (xh, yh, tau), mass in states.items():
            joint = coupling_joint(kernel(laws, "p", xh), kernel(laws, "q", yh))
            for x, y in zip(*np.nonzero(joint > 0), strict=True):
                m = mass * joint[x, y]
                new_tau = t if (x != y and tau > H) else tau
                mismatch[t - 1] += m * (x != y)
                key = (xh + (int(x),), yh + (int(y),), new_tau)
                nxt[key] = nxt.get(key, 0.0) + m
        states = nxt
    p = np.zeros(H)
    for (_, _, tau), mass in states.items():
        if tau <= H:
            p[tau - 1] += mass
    R = mismatch.sum() / H
    O = p.sum() / H
    return {"p": p, "R": R, "O": O, "Pi": R - O, "cdf": np.cumsum(p)}


@pytest.fixture(scope="module")
def swrb(setup):
    model, ids, _ = setup
    return swrb_rollout_document(model, ids, [ACTION], "tiny", N_REP, [EOS], H, SEED)[
        ACTION["name"]
    ]


def within(values: np.ndarray, target: float, z: float = 4.5) -> None:
    mean = values.mean()
    se = values.std(ddof=1) / np.sqrt(values.size)
    assert abs(mean - target) <= z * se + 1e-12, (mean, target, se)


def test_exact_answers_have_power(exact):
    assert 0.1 < exact["p"].sum() < 0.9  # divergence within H neither rare nor certain
    assert exact["Pi"] > 0.02  # the continuation matters for R_SMC
    assert exact["p"][0] == 0.0  # eviction follows the prefill: δ_1 = 0


def test_scan_laws_equal_the_exact_kernels(swrb, setup):
    """e_s on every sampled trunk is TV(P(·|U_<s), Q(·|U_<s)) of the plain forward."""
    _, _, laws = setup
    for r in range(40):
        trunk = swrb.trunk[r]
        for s in range(1, H + 1):
            history = tuple(int(u) for u in trunk[: s - 1])
            if -1 in history or EOS in history:
                assert swrb.e[r, s - 1] == 0.0
                continue
            p, q = kernel(laws, "p", history), kernel(laws, "q", history)
            assert swrb.e[r, s - 1] == pytest.approx(0.5 * np.abs(p - q).sum(), abs=2e-5)
            if trunk[s - 1] >= 0:  # U_s lies in the overlap's support
                assert min(p[trunk[s - 1]], q[trunk[s - 1]]) > 0


def test_branch_structure_and_cost(swrb):
    """Before J the pair follows the trunk, at J the residual pair differs; M = 1 − Π(1 − e);
    the cost counts the scan's two rows per evaluated step after the first and the branch's
    running sides over J + 1..H."""
    w, M = survival_weights(swrb.e)
    np.testing.assert_allclose(swrb.weight, M)
    np.testing.assert_allclose(M, 1 - np.prod(1 - swrb.e, axis=1), atol=1e-12)
    mismatch = swrb.mismatch
    for r in range(N_REP):
        J = swrb.entry[r]
        if J > H:
            assert swrb.weight[r] == 0 and not mismatch[r].any()
            continue
        assert w[r, J - 1] > 0
        assert not mismatch[r, : J - 1].any() and mismatch[r, J - 1]
        np.testing.assert_array_equal(swrb.x_token[r, : J - 1], swrb.trunk[r, : J - 1])
        ended_x = np.cumsum(swrb.x_token[r] == EOS) > 0
        ended_y = np.cumsum(swrb.y_token[r] == EOS) > 0
        steps = np.arange(J + 1, H + 1)  # continuation steps; a side runs if not ended before
        expected = (~ended_x[steps - 2]).sum() + (~ended_y[steps - 2]).sum()
        assert swrb.cost_continuation[r] == expected
    np.testing.assert_array_equal(swrb.cost_scan, 2 * (swrb.scan_steps - 1))
    assert (swrb.entry <= H).mean() > 0.5


def test_swrb_estimators_are_unbiased(swrb, exact):
    """Z^R, Z^O, Z^Π, the smooth CDF Σ_{s≤t} w_s and M·1{J = s} against the exact values."""
    w, M = survival_weights(swrb.e)
    D = swrb.mismatch.sum(1) / H
    within(M * D, exact["R"])
    within(M / H, exact["O"])
    within(M * (D - 1 / H), exact["Pi"])
    cdf = np.cumsum(w, axis=1)
    for s in range(1, H + 1):
        within(cdf[:, s - 1], exact["cdf"][s - 1])
        within(M * (swrb.entry == s), exact["p"][s - 1])


def test_swrb_variance_no_larger_for_occurrence_and_cdf(swrb, exact):
    """Per replicate, Var(M/H) ≤ Var(B/H) = O_H(1/H − O_H) (the naive Bernoulli's exactly)."""
    naive_var = exact["O"] * (1 / H - exact["O"])
    assert (swrb.weight / H).var() <= naive_var


def test_naive_engine_agrees_with_the_exact_values(setup, exact):
    model, ids, _ = setup
    r = rollout_document(
        model, ids, ACTION, "tiny", N_REP, [EOS], RolloutSettings(H, SEED, max_batch_rows=4 * N_REP)
    )
    mismatch = r.x_token != r.y_token
    B = mismatch.any(1)
    D = mismatch.sum(1) / H
    within(D, exact["R"])
    within(B / H, exact["O"])
    within(D - B / H, exact["Pi"])
    tau = np.where(B, mismatch.argmax(1) + 1, H + 1)
    for s in range(1, H + 1):
        within((tau <= s).astype(float), exact["cdf"][s - 1])


def test_rerun_is_bit_identical_and_keyed_by_replicate(setup, swrb):
    model, ids, _ = setup
    again = swrb_rollout_document(model, ids, [ACTION], "tiny", [7, 3, 100], [EOS], H, SEED)
    part = again[ACTION["name"]]
    for i, r in enumerate([7, 3, 100]):
        np.testing.assert_allclose(part.e[i], swrb.e[r], atol=1e-6)
        assert part.entry[i] == swrb.entry[r]
        np.testing.assert_array_equal(part.x_token[i], swrb.x_token[r])
        np.testing.assert_array_equal(part.y_token[i], swrb.y_token[r])
