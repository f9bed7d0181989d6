"""SWRB for language-model rollouts (kvdiverge.engine.swrb_rollout) against exact enumerated
answers.

A tiny causal LM (random weights, 5 tokens of which 4 is EOS, a 40-token prompt, H = 4) with an
evicting action: every next-token law P(·|h) (full cache) and Q(·|h) (evicted cache) is computed
by plain transformers forwards over a cache of the kept prompt entries, for every history h, and
the coupled pair's exact R_SMC, O_H, Π_H and first-divergence law p_s are enumerated from the
maximal-coupling joint laws, independently of the engine and of the code under test.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import polars as pl
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvdiverge.analysis.swrb import (
    document_means,
    estimates_from_records,
    naive_replicate_values,
    swrb_estimates,
    swrb_replicate_values,
    swrb_study_table,
)
from kvdiverge.engine import RolloutSettings, paths_under_action
from kvdiverge.engine.swrb_job import run_swrb_job
from kvdiverge.engine.swrb_rollout import swrb_rollout_document
from kvdiverge.eviction import kept_positions
from kvdiverge.io.swrb_records import (
    SwrbFormatError,
    SwrbRollout,
    read_swrb_metadata,
    read_swrb_records,
    record_arrays,
    swrb_frame,
    write_swrb_records,
)
from kvdiverge.theory.coupling import tempered_kernel
from kvdiverge.theory.survival import survival_weights

V, EOS, H = 5, 4, 4
ACTION = {"name": "recent-32", "selector": "recent", "budget": 32}
N_REP = 3000
L = 2  # window of the identified-interval terms
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
    return model, ids, all_laws(model, ids)


def all_laws(model, ids, temperature: float = 1.0) -> dict:
    """(side, history) → the exact next-token law at ``temperature`` for every history of up
    to H − 1 tokens, side ``p`` on the full cache and ``q`` on ACTION's evicted cache."""
    laws = {}
    for name, selector in (("p", {"name": "f", "selector": "full"}), ("q", ACTION)):
        kept = kept_positions(model, ids, selector)
        first, after = next_token_laws(model, ids, kept, temperature)
        laws[name, ()] = first
        for leaf, probs in zip(itertools.product(range(V), repeat=H - 1), after, strict=True):
            for j in range(H - 1):
                laws[name, leaf[: j + 1]] = probs[j]
    return laws


def softmax_at(logits: torch.Tensor, temperature: float) -> np.ndarray:
    """softmax(logits / T) along the last axis, in numpy float64 (T = 1: torch's own softmax,
    as the untempered kernel has always been computed)."""
    if temperature == 1:
        return logits.double().softmax(-1).numpy()
    z = logits.double().numpy() / temperature
    z = np.exp(z - z.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


@torch.no_grad()
def next_token_laws(model, ids, kept, temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Plain transformers forwards: the law after the prompt, and (V^(H−1), H − 1, V) the laws
    after every prefix of every history of H − 1 tokens, fed at positions n.. over a
    DynamicCache holding the kept prompt entries of every layer and KV head; the laws are
    softmax(logits / ``temperature``)."""
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
    return softmax_at(out.logits[0, -1], temperature), softmax_at(logits, temperature)


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
    return exact_values(setup[2])


def exact_values(laws: dict) -> dict:
    """Exact E[I_t], p_s = P(τ = s), R_SMC, O_H and Π_H by enumerating the coupled paths."""
    states = {((), (), H + 1): 1.0}  # (x history, y history, τ) → probability
    mismatch = np.zeros(H)
    window = 0.0  # E[Σ_{j<ℓ_τ} I_{τ+j}]
    for t in range(1, H + 1):
        nxt: dict = {}
        for (xh, yh, tau), mass in states.items():
            joint = coupling_joint(kernel(laws, "p", xh), kernel(laws, "q", yh))
            for x, y in zip(*np.nonzero(joint > 0), strict=True):
                m = mass * joint[x, y]
                new_tau = t if (x != y and tau > H) else tau
                mismatch[t - 1] += m * (x != y)
                window += m * (x != y) * (new_tau <= H and t < new_tau + L)
                key = (xh + (int(x),), yh + (int(y),), new_tau)
                nxt[key] = nxt.get(key, 0.0) + m
        states = nxt
    p = np.zeros(H)
    for (_, _, tau), mass in states.items():
        if tau <= H:
            p[tau - 1] += mass
    R = mismatch.sum() / H
    O = p.sum() / H
    s = np.arange(1, H + 1)
    ell = np.minimum(L, H - s + 1)
    return {
        "p": p,
        "R": R,
        "O": O,
        "Pi": R - O,
        "cdf": np.cumsum(p),
        "R_L": window / H,
        "B_L": (p * (H - s + 1 - ell)).sum() / H,
        "entry_moment": (p * s).sum(),
    }


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
    """Z^R, Z^O, Z^Π, Z_L, W_L, the smooth CDF Σ_{s≤t} w_s, Σ_s s·w_s and M·1{J = s} (through
    kvdiverge.analysis.swrb) against the exact values."""
    v = swrb_replicate_values(swrb.e, swrb.entry, swrb.mismatch, windows=[L])
    within(v["R_smc"], exact["R"])
    within(v["O_H"], exact["O"])
    within(v["Pi_H"], exact["Pi"])
    within(v[f"Z_L@{L}"], exact["R_L"])
    within(v[f"W_L@{L}"], exact["B_L"])
    within(v["entry_moment"], exact["entry_moment"])
    for s in range(1, H + 1):
        within(v[f"div_cdf@{s}"], exact["cdf"][s - 1])
        within(swrb.weight * (swrb.entry == s), exact["p"][s - 1])
    assert exact["B_L"] > 0.01 and exact["R_L"] < exact["R"] - 0.01  # the window cuts


def test_swrb_variance_no_larger_for_occurrence_and_cdf(swrb, exact):
    """Per replicate, Var(M/H) ≤ Var(B/H) = O_H(1/H − O_H) (the naive Bernoulli's exactly)."""
    naive_var = exact["O"] * (1 / H - exact["O"])
    assert (swrb.weight / H).var() <= naive_var


def test_naive_engine_agrees_with_the_exact_values(setup, exact):
    model, ids, _ = setup
    r = paths_under_action(
        model, ids, ACTION, "tiny", N_REP, [EOS], RolloutSettings(H, SEED, max_batch_rows=4 * N_REP)
    )
    v = naive_replicate_values(r.x_token != r.y_token, windows=[L])
    within(v["R_smc"], exact["R"])
    within(v["O_H"], exact["O"])
    within(v["Pi_H"], exact["Pi"])
    within(v[f"Z_L@{L}"], exact["R_L"])
    within(v[f"W_L@{L}"], exact["B_L"])
    for s in range(1, H + 1):
        within(v[f"div_cdf@{s}"], exact["cdf"][s - 1])


T_LOW = 0.5  # a decoding temperature != 1 (rollout.temperature)


@pytest.fixture(scope="module")
def tempered(setup):
    """The exact laws and values and the SWRB replicates at T = T_LOW."""
    model, ids, _ = setup
    laws = all_laws(model, ids, T_LOW)
    result = swrb_rollout_document(
        model, ids, [ACTION], "tiny", N_REP, [EOS], H, SEED, temperature=T_LOW
    )
    return laws, exact_values(laws), result[ACTION["name"]]


def test_tempered_scan_laws_are_softmax_of_the_logits_over_T(tempered, setup):
    """At T = 0.5, e_s on every sampled trunk is TV(softmax(z_P / T), softmax(z_Q / T)) of the
    plain forward's logits z (not the T = 1 laws' TV), and U_s lies in that overlap's
    support."""
    laws, _, result = tempered
    moved = 0.0
    for r in range(40):
        trunk = result.trunk[r]
        for s in range(1, H + 1):
            history = tuple(int(u) for u in trunk[: s - 1])
            if -1 in history or EOS in history:
                assert result.e[r, s - 1] == 0.0
                continue
            p, q = kernel(laws, "p", history), kernel(laws, "q", history)
            assert result.e[r, s - 1] == pytest.approx(0.5 * np.abs(p - q).sum(), abs=2e-5)
            p1, q1 = kernel(setup[2], "p", history), kernel(setup[2], "q", history)
            moved = max(moved, abs(result.e[r, s - 1] - 0.5 * np.abs(p1 - q1).sum()))
            if trunk[s - 1] >= 0:
                assert min(p[trunk[s - 1]], q[trunk[s - 1]]) > 0
    assert moved > 0.01  # the temperature changes the laws compared


def test_tempered_swrb_estimators_are_unbiased(tempered, exact):
    """At T = 0.5 the SWRB estimators match the exact values enumerated from the tempered
    kernels, which differ from the T = 1 values by far more than the test's tolerance."""
    _, exact_t, result = tempered
    # sharper kernels: divergence by H is likelier than at T = 1 (0.88) but not certain
    assert 0.1 < exact_t["p"].sum() < 0.995 and exact_t["Pi"] > 0.02
    v = swrb_replicate_values(result.e, result.entry, result.mismatch, windows=[L])
    checks = [("R_smc", "R"), ("O_H", "O"), ("Pi_H", "Pi"), (f"Z_L@{L}", "R_L")]
    checks += [(f"div_cdf@{s}", ("cdf", s - 1)) for s in range(1, H + 1)]
    for key, target in checks:
        value, at_one = (
            (exact_t[target[0]][target[1]], exact[target[0]][target[1]])
            if isinstance(target, tuple)
            else (exact_t[target], exact[target])
        )
        within(v[key], value)
        se = v[key].std(ddof=1) / np.sqrt(v[key].size)
        if key in ("R_smc", "O_H", "div_cdf@2", "div_cdf@4"):  # these tell T = 0.5 from 1
            assert abs(value - at_one) > 6 * se, key


def test_temperature_one_is_bit_identical_to_the_default(setup):
    """temperature=1 (int or float) gives the default's records bit for bit: the kernel at
    T = 1 is softmax(logits) itself, in the same float64 operations as before."""
    model, ids, _ = setup
    name = ACTION["name"]
    default = swrb_rollout_document(model, ids, [ACTION], "tiny", 200, [EOS], H, SEED)[name]
    for T in (1, 1.0):
        at_one = swrb_rollout_document(
            model, ids, [ACTION], "tiny", 200, [EOS], H, SEED, temperature=T
        )[name]
        for field in dataclasses.fields(SwrbRollout):
            a, b = getattr(default, field.name), getattr(at_one, field.name)
            if isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), field.name
            else:
                assert a == b, field.name
    z = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tempered_kernel(z, 1.0), z.double().softmax(-1))
    assert not torch.equal(tempered_kernel(z, T_LOW), z.double().softmax(-1))


@pytest.mark.parametrize(
    "T, message",
    [
        (0, "temperature: 0 (greedy) is not run by SWRB: greedy kernels are point masses"),
        (-1.0, "temperature: expected a finite number > 0, got -1.0"),
        (float("nan"), "temperature: expected a finite number > 0, got nan"),
    ],
)
def test_swrb_refuses_greedy_and_bad_temperatures(setup, T, message):
    model, ids, _ = setup
    with pytest.raises(ValueError) as info:
        swrb_rollout_document(model, ids, [ACTION], "tiny", 2, [EOS], H, SEED, temperature=T)
    assert str(info.value).startswith(message)


def test_document_estimates_and_bootstrap(swrb, exact):
    """Document means, pooled estimands and intervals: four pseudo-documents (replicate quarters)
    in two strata; point values are the pooled means, intervals contain them."""
    v = swrb_replicate_values(swrb.e, swrb.entry, swrb.mismatch, windows=[L])
    docs = np.repeat(["a/0", "a/1", "b/0", "b/1"], N_REP // 4)
    means = document_means(v, docs)
    assert means["n_replicates"].to_list() == [N_REP // 4] * 4
    table = swrb_estimates(means, ["a", "a", "b", "b"], draws=400, seed=1)
    row = table.filter(pl.col("estimand") == "R_smc").row(0, named=True)
    assert row["value"] == pytest.approx(v["R_smc"].mean())
    assert row["lo"] <= row["value"] <= row["hi"]
    met = table.filter(pl.col("estimand") == "mean_entry_time").row(0, named=True)
    expected = exact["entry_moment"] / exact["p"].sum()
    assert met["value"] == pytest.approx(expected, abs=0.05)


def test_records_round_trip_and_contract(swrb, tmp_path):
    frame = swrb_frame([swrb])
    meta = {
        "model": "tiny",
        "action": ACTION,
        "H": H,
        "K": N_REP,
        "seed": SEED,
        "coupling": "swrb",
        "dtype": "float32",
        "device": "cpu",
        "n_documents": 1,
    }
    path = tmp_path / "swrb.parquet"
    write_swrb_records(frame, path, meta)
    back = read_swrb_records(path)
    assert back.equals(frame)
    arrays = record_arrays(back)
    np.testing.assert_array_equal(arrays["e"], swrb.e)
    np.testing.assert_array_equal(arrays["J"], swrb.entry)
    assert read_swrb_metadata(path)["H"] == H
    branch = int(np.flatnonzero(swrb.entry <= H)[0])
    J = int(swrb.entry[branch])
    broken = {
        "M": (frame.with_columns(pl.col("M") * 0.5), "expected 1 − Π"),
        "J": (frame.with_columns(pl.lit(H + 2).cast(pl.Int16).alias("J")), "expected 1.."),
        "pair": (
            frame.with_columns(
                pl.when(pl.col("replicate") == branch)
                .then(pl.col("x_token"))
                .otherwise(pl.col("y_token"))
                .alias("y_token")
            ),
            f"at J = {J}",
        ),
        "cost": (frame.with_columns(pl.col("cost_scan") + 1), "cost_scan"),
        "docs": (frame, "n_documents"),
    }
    for name, (bad, message) in broken.items():
        bad_meta = {**meta, "n_documents": 2} if name == "docs" else meta
        with pytest.raises(SwrbFormatError, match=message):
            write_swrb_records(bad, tmp_path / f"{name}.parquet", bad_meta)
    with pytest.raises(SwrbFormatError, match="expected 'swrb'"):
        write_swrb_records(frame, tmp_path / "other.parquet", {**meta, "coupling": "independent"})
        read_swrb_records(tmp_path / "other.parquet")


def test_rerun_is_bit_identical_and_keyed_by_replicate(setup, swrb):
    model, ids, _ = setup
    again = swrb_rollout_document(model, ids, [ACTION], "tiny", [7, 3, 100], [EOS], H, SEED)
    part = again[ACTION["name"]]
    for i, r in enumerate([7, 3, 100]):
        np.testing.assert_allclose(part.e[i], swrb.e[r], atol=1e-6)
        assert part.entry[i] == swrb.entry[r]
        np.testing.assert_array_equal(part.x_token[i], swrb.x_token[r])
        np.testing.assert_array_equal(part.y_token[i], swrb.y_token[r])


def test_actions_batched_together_equal_each_alone(setup):
    """Several actions in one batch (their Q rows on their own evicted caches): each action's
    e_s and tokens equal its run alone (to float rounding)."""
    model, ids, _ = setup
    other = {"name": "snapkv-20", "selector": "snapkv", "budget": 20, "window": 8}
    together = swrb_rollout_document(model, ids, [other, ACTION], "tiny", 60, [EOS], H, SEED)
    for action in (other, ACTION):
        alone = swrb_rollout_document(model, ids, [action], "tiny", 60, [EOS], H, SEED)
        a, b = alone[action["name"]], together[action["name"]]
        np.testing.assert_allclose(a.e, b.e, atol=1e-6)
        assert (a.x_token == b.x_token).mean() > 0.99
        assert (a.y_token == b.y_token).mean() > 0.99
    assert not np.allclose(together[other["name"]].e, together[ACTION["name"]].e)


def test_swrb_job_writes_records_and_tables(tmp_path):
    """Documents file → run_swrb_job (the tiny demo model) → checked record files → per-stratum
    and pooled estimands with intervals."""
    prompts = ["The river flows north past the mill. " * 6, "A short note on stone bridges. " * 6]
    documents = tmp_path / "documents.parquet"
    pl.DataFrame(
        {
            "doc_id": ["rag-4k/study1/0", "rag-4k/study1/1"],
            "stratum": ["rag-4k", "rag-4k"],
            "cohort": ["study1", "study1"],
            "prompt": prompts,
        }
    ).write_parquet(documents)
    actions = {
        "recent-half": {"selector": "recent", "budget": 0.5},
        "snapkv-half": {"selector": "snapkv", "budget": 0.5, "window": 8},
    }
    out = {name: tmp_path / f"{name}.parquet" for name in actions}
    frames = run_swrb_job(
        documents,
        out,
        {"path": "data/models/tiny-llama", "dtype": "float32"},
        actions,
        {name: {"study1": 6} for name in actions},
        H=6,
        seed=3,
        device="cpu",
    )
    for name, path in out.items():
        back = read_swrb_records(path)
        assert back.equals(frames[name]) and back.height == 12
        assert read_swrb_metadata(path)["K"] == {"study1": 6}
        assert read_swrb_metadata(path)["temperature"] == 1.0
    # max_batch_rows = 4: one replicate of both actions per scan call, the same records
    chunked_out = {name: tmp_path / f"chunked-{name}.parquet" for name in actions}
    chunked = run_swrb_job(
        documents,
        chunked_out,
        {"path": "data/models/tiny-llama", "dtype": "float32"},
        actions,
        {name: {"study1": 6} for name in actions},
        H=6,
        seed=3,
        device="cpu",
        metadata={"lock": "abc"},
        max_batch_rows=4,
    )
    for name in actions:
        a, b = record_arrays(frames[name]), record_arrays(chunked[name])
        assert (a["doc_id"] == b["doc_id"]).all() and (a["replicate"] == b["replicate"]).all()
        np.testing.assert_allclose(a["e"], b["e"], atol=1e-5)  # float32 batch shapes
        assert (a["x_token"] == b["x_token"]).mean() > 0.95
        assert read_swrb_metadata(chunked_out[name])["lock"] == "abc"
    strata = {"rag-4k/study1/0": "rag-4k", "rag-4k/study1/1": "rag-4k"}
    table = estimates_from_records(out, strata, draws=200)
    assert set(table["stratum"]) == {"all", "rag-4k"}
    assert set(table["action"]) == set(actions)
    row = table.filter(
        (pl.col("action") == "recent-half")
        & (pl.col("stratum") == "all")
        & (pl.col("estimand") == "R_smc")
    ).row(0, named=True)
    arrays = record_arrays(read_swrb_records(out["recent-half"]))
    w, M = survival_weights(arrays["e"])
    D = (arrays["x_token"] != arrays["y_token"]).mean(1)
    assert row["value"] == pytest.approx((M * D).mean())
    assert row["lo"] <= row["value"] <= row["hi"]
    # the pipeline's layout: per model, action and contrast, paired draws, the same values
    study = swrb_study_table(
        {"m": {name: {"rag-4k": path} for name, path in out.items()}},
        contrasts=[["snapkv-half", "recent-half"]],
        windows=[2],
        draws=200,
    )
    assert set(study["stratum"]) == {"pooled", "rag-4k"}
    pooled = study.filter(pl.col("stratum") == "pooled")
    r_smc = pooled.filter((pl.col("action") == "recent-half") & (pl.col("estimand") == "R_smc"))
    assert r_smc["value"].item() == pytest.approx(row["value"])
    assert r_smc["n_docs"].item() == 2 and r_smc["n_paths"].item() == 12
    other = record_arrays(read_swrb_records(out["snapkv-half"]))
    o_h = {
        name: survival_weights(a["e"])[1].mean() / 6
        for name, a in (("recent-half", arrays), ("snapkv-half", other))
    }
    diff = pooled.filter(
        (pl.col("contrast") == "snapkv-half - recent-half") & (pl.col("estimand") == "O_H")
    )
    assert diff["value"].item() == pytest.approx(o_h["snapkv-half"] - o_h["recent-half"])
    assert diff["ci_low"].item() <= diff["value"].item() <= diff["ci_high"].item()
    assert diff["n_paths"].item() == 24 and set(pooled["draws_dropped"]) <= set(range(201))
    assert {"Z_L@2", "W_L@2", "div_cdf@6", "mean_entry_time"} <= set(pooled["estimand"])


def test_swrb_job_runs_at_a_temperature_and_records_it(tmp_path):
    """run_swrb_job at T = 0.5: the records are swrb_documents_actions' at T = 0.5 (not its
    T = 1 records), the metadata holds the temperature; T = 0 and a metadata key
    ``temperature`` are refused in one line before the model loads."""
    from kvdiverge.engine.swrb_job import swrb_documents_actions
    from kvdiverge.models import eos_token_ids, load_model, load_tokenizer

    prompt = "The river flows north past the mill. " * 6
    documents = tmp_path / "documents.parquet"
    pl.DataFrame(
        {"doc_id": ["d/0"], "stratum": ["d"], "cohort": ["c"], "prompt": [prompt]}
    ).write_parquet(documents)
    model = {"path": "data/models/tiny-llama", "dtype": "float32"}
    actions = {"recent-half": {"selector": "recent", "budget": 0.5}}
    out = {"recent-half": tmp_path / "recent-half.parquet"}
    frames = run_swrb_job(
        documents, out, model, actions, {"recent-half": {"c": 8}}, H=6, seed=3, device="cpu",
        temperature=0.5,
    )  # fmt: skip
    meta = read_swrb_metadata(out["recent-half"])
    assert meta["temperature"] == 0.5 and meta["coupling"] == "swrb"
    lm = load_model(model["path"], dtype="float32", device="cpu")
    tokenizer = load_tokenizer(model["path"])
    spec = [{"name": "recent-half", **actions["recent-half"]}]
    direct = {
        T: swrb_documents_actions(
            lm,
            tokenizer,
            [("d/0", prompt, {"recent-half": 8})],
            spec,
            eos_token_ids(lm, tokenizer),
            6,
            3,
            temperature=T,
        )["recent-half"]
        for T in (0.5, 1.0)
    }
    job, half, one = (record_arrays(f) for f in (frames["recent-half"], *direct.values()))
    np.testing.assert_allclose(job["e"], half["e"], atol=1e-6)
    assert (job["x_token"] == half["x_token"]).all() and (job["y_token"] == half["y_token"]).all()
    assert not np.allclose(half["e"], one["e"], atol=1e-3)
    missing = {"path": str(tmp_path / "no-model"), "dtype": "float32"}  # never loaded
    for kwargs, message in (
        ({"temperature": 0}, "temperature: 0 (greedy) is not run by SWRB"),
        ({"metadata": {"temperature": 2}}, "metadata: key(s) temperature are set by the job"),
    ):
        with pytest.raises(ValueError) as info:
            run_swrb_job(
                documents, out, missing, actions, {"recent-half": {"c": 8}}, H=6, seed=3,
                device="cpu", **kwargs,
            )  # fmt: skip
        assert str(info.value).startswith(message)
