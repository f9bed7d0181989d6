"""The plan on a study's prespecified endpoints (issue 28 item 2): K and the documents sized for
the family's endpoints at the family level, the binding endpoint named; checked against a
simulated two-stage population with known between- and within-document variances, whose exact
optimum the test computes on its own; the plan's path statistics equal the analysis's."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
from scipy.stats import norm

from kvdiverge.analysis.document_stats import Clock, path_statistics, stat_columns
from kvdiverge.analysis.planning import development_paths, endpoint_path_values, study_plan
from kvdiverge.io.trajectories import TRAJECTORY_SCHEMA, write_trajectories

H = 16
N_PROMPT = 2000
CLOCK = {"branch_depth": 0.5, "window": 0.125, "saturation": 0.99}


def _write(path, doc_ids, mismatch, delta, n_prompt=N_PROMPT) -> None:
    """A development trajectory file from (paths, H) grids; doc_ids per path, replicates
    numbered within each document."""
    n = mismatch.shape[0]
    doc_ids = np.asarray(doc_ids)
    replicate = np.zeros(n, dtype=np.int32)
    for d in np.unique(doc_ids):
        rows = np.flatnonzero(doc_ids == d)
        replicate[rows] = np.arange(rows.size)
    y = mismatch.astype(np.int32)
    frame = pl.DataFrame(
        {
            "doc_id": np.repeat(doc_ids, H),
            "replicate": np.repeat(replicate, H),
            "t": np.tile(np.arange(1, H + 1), n),
            "x_token": np.zeros(n * H, dtype=np.int32),
            "y_token": y.ravel(),
            "mismatch": mismatch.ravel(),
            "tv_rollout": delta.ravel(),
            "tv_fixed": np.zeros(n * H),
            "x_eos": np.zeros(n * H, dtype=bool),
            "y_eos": np.zeros(n * H, dtype=bool),
            "n_prompt": np.full(n * H, n_prompt),
            "n_kept": np.full(n * H, n_prompt // 2),
        }
    ).with_columns([pl.col(c).cast(t) for c, t in TRAJECTORY_SCHEMA.items()])
    K = int(np.bincount(np.unique(doc_ids, return_inverse=True)[1]).max())
    meta = {
        "model": "m", "revision": None, "action": {"name": "a"}, "H": H, "K": {"dev": K},
        "seed": 0, "coupling": "shared-reference", "dtype": "float32", "device": "cpu",
        "n_documents": int(np.unique(doc_ids).size),
    }  # fmt: skip
    write_trajectories(frame.select(list(TRAJECTORY_SCHEMA)), path, meta)


STRATUM_MEANS = {"s1": 0.3, "s2": 0.5}


def _population(tmp_path, sigma_b: dict[str, float], n_docs: int, K: int, seed: int) -> dict:
    """Two-stage population of S_99 paths: document level μ_i = stratum mean + N(0, σ_b²),
    each step saturated (δ_t = 1) with probability μ_i, so a path's S_99 is Binomial(H, μ_i)/H:
    σ_w² = E[μ(1 − μ)]/H. No mismatch anywhere (2H row-steps per replicate)."""
    rng = np.random.default_rng(seed)
    files = {}
    for action, sb in sigma_b.items():
        for stratum, mean in STRATUM_MEANS.items():
            mu = np.clip(mean + rng.normal(0, sb, n_docs), 0, 1)
            doc_ids = np.repeat([f"{stratum}/dev/{i:04d}" for i in range(n_docs)], K)
            delta = (rng.random((n_docs * K, H)) < np.repeat(mu, K)[:, None]).astype(float)
            path = tmp_path / f"{action}-{stratum}.parquet"
            _write(path, doc_ids, np.zeros((n_docs * K, H), dtype=bool), delta)
            files[("m", action, stratum)] = path
    zero = tmp_path / "full.parquet"
    for stratum in STRATUM_MEANS:
        doc_ids = np.repeat([f"{stratum}/dev/{i:04d}" for i in range(n_docs)], 2)
        path = tmp_path / f"full-{stratum}.parquet"
        _write(path, doc_ids, np.zeros((n_docs * 2, H), bool), np.zeros((n_docs * 2, H)))
        files[("m", "full", stratum)] = path
    del zero
    return files


def _true_components(sigma_b: float) -> tuple[float, float]:
    """σ_b² and σ_w² = E[μ(1 − μ)]/H of the population (averaged over the equal strata)."""
    within = np.mean([m * (1 - m) - sigma_b**2 for m in STRATUM_MEANS.values()]) / H
    return sigma_b**2, float(within)


def _exact_optimum(sb2, sw2, c_doc, c_rep, hw, z, n_strata, min_per_stratum, max_K):
    """Least-cost (K, n) by walking n upwards for every K (independent of the plan's code)."""
    best = None
    for K in range(1, max_K + 1):
        n = n_strata * min_per_stratum
        while z * math.sqrt((sb2 + sw2 / K) / n) > hw:
            n += n_strata
        cost = n * (c_doc + K * c_rep)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, K, n)
    return best


def _smallest_K(sb2, sw2, n, hw, z, max_K):
    ok = [K for K in range(1, max_K + 1) if z * math.sqrt((sb2 + sw2 / K) / n) <= hw]
    return ok[0] if ok else None


def test_the_plan_sizes_the_endpoints_at_the_family_level(tmp_path):
    sigma_b = {"snap": 0.09, "recent": 0.03}
    files = _population(tmp_path, sigma_b, n_docs=1000, K=8, seed=1)
    level = 1 - 0.05 / 8
    endpoints = {
        "level": level,
        "estimands": ["S_99", "branch_contrast_B"],
        "family": [
            {"model": "m", "action": a, "estimand": e}
            for a in ("snap", "recent")
            for e in ("S_99", "branch_contrast_B")
        ],
        "clock": CLOCK,
    }
    hw, max_K, per_stratum = 0.02, 64, 150
    plan = study_plan(
        files,
        actions=["snap", "recent", "full"],
        control="full",
        documents_per_stratum=per_stratum,
        cohort="study2",
        half_width=hw,
        level=0.95,  # replaced by the family level
        max_K=max_K,
        endpoints=endpoints,
    )
    z = norm.ppf(0.5 + level / 2)
    assert plan["estimand"] == "endpoints" and plan["level"] == level
    s99 = {e["action"]: e for e in plan["plans"] if e["estimand"] == "S_99"}
    assert set(s99) == {"snap", "recent"}
    for action, entry in s99.items():
        sb2, sw2 = _true_components(sigma_b[action])
        assert entry["sigma_between2"] == pytest.approx(sb2, rel=0.3)
        assert entry["sigma_within2"] == pytest.approx(sw2, rel=0.05)
        assert entry["c_doc"] == N_PROMPT and entry["c_rep"] == 2 * H
        # the plan's least-cost design is the exact optimum for its components ...
        cost, K, n = _exact_optimum(
            entry["sigma_between2"], entry["sigma_within2"], N_PROMPT, 2 * H, hw, z, 2, 2, max_K
        )
        assert (entry["K"], entry["n_docs"]) == (K, n)
        assert entry["cost"] == pytest.approx(cost)
        # ... and near the optimum for the population's own components (the cost is flat
        # there), at a cost within 5% of it
        # (for the binding action; the other's σ_b² is small, its optimum K large and flat)
        true_cost, true_K, _ = _exact_optimum(sb2, sw2, N_PROMPT, 2 * H, hw, z, 2, 2, max_K)
        if action == "snap":
            assert abs(entry["K"] - true_K) <= max(1, 0.25 * true_K)
            per_doc = sb2 + sw2 / entry["K"]
            n_at_K = 2 * math.ceil((z / hw) ** 2 * per_doc / 2)
            assert n_at_K * (N_PROMPT + entry["K"] * 2 * H) <= 1.05 * true_cost
        assert entry["K_needed"] == _smallest_K(
            entry["sigma_between2"], entry["sigma_within2"], 2 * per_stratum, hw, z, max_K
        )
        truth = _smallest_K(sb2, sw2, 2 * per_stratum, hw, z, max_K)
        assert entry["K_needed"] is not None and truth is not None
        assert entry["K_needed"] == truth
    # the noisier action binds, and the plan says so
    assert plan["binding"] == {
        "model": "m",
        "action": "snap",
        "estimand": "S_99",
        "K": s99["snap"]["K_needed"],
        "docs_per_stratum_needed": s99["snap"]["evaluation"]["docs_per_stratum_needed"],
    }
    assert plan["K"] == plan["K_planned"] == s99["snap"]["K_needed"] > s99["recent"]["K_needed"]
    # no path diverges, so B(a) has no branch cohort: planned on R_SMC, said in one line each
    assert [n for n in plan["notes"] if n.startswith("endpoint")] == [
        "endpoint branch_contrast_B of m/snap is planned on R_smc: no development path entered "
        "the branch cohort",
        "endpoint branch_contrast_B of m/recent is planned on R_smc: no development path "
        "entered the branch cohort",
    ]
    # without endpoints: as before, R_SMC at the planning level
    plain = study_plan(
        files, actions=["snap", "recent", "full"], control="full",
        documents_per_stratum=per_stratum, cohort="study2", half_width=hw, max_K=max_K,
    )  # fmt: skip
    assert plain["estimand"] == "R_smc" and plain["level"] == 0.95
    assert {e["estimand"] for e in plain["plans"]} == {"R_smc"}


def test_the_plans_path_statistics_are_the_analysis_statistics(tmp_path):
    """S_99, the branch cohort and the early and late windows per path, as the plan computes
    them, equal kvdiverge.analysis.document_stats.path_statistics; B(a)'s linearisation
    averages to zero over documents at the development estimate."""
    rng = np.random.default_rng(5)
    n_docs, K = 6, 4
    doc_ids = np.repeat([f"s1/dev/{i:03d}" for i in range(n_docs)], K)
    rate = rng.uniform(0.02, 0.3, n_docs * K)[:, None]
    mismatch = rng.random((n_docs * K, H)) < rate
    delta = np.where(rng.random((n_docs * K, H)) < 0.3, 0.995, rng.random((n_docs * K, H)) * 0.9)
    delta = np.maximum(delta, mismatch * 0.5).astype(np.float32)
    path = tmp_path / "dev.parquet"
    _write(path, doc_ids, mismatch, delta)
    paths = development_paths(path, "s1", CLOCK)
    clock = Clock.for_horizon(H, **CLOCK)
    falses = np.zeros_like(mismatch)
    ref = path_statistics(mismatch, delta, np.zeros_like(delta), falses, falses, clock)
    col = {name: ref[:, i] for i, name in enumerate(stat_columns(clock))}
    d, w = clock.branch_depth, clock.window
    assert np.allclose(paths["saturation"], col["saturation"])
    assert np.allclose(paths["mismatch"], col["mismatch"])
    assert np.allclose(paths["branch_cohort"], col["branch_cohort"])
    early = sum(col[f"branch@{j}"] for j in range(1, w + 1)) / w
    late = sum(col[f"branch@{j}"] for j in range(d - w + 1, d + 1)) / w
    assert np.allclose(paths["branch_early"], early)
    assert np.allclose(paths["branch_late"], late)
    u = endpoint_path_values(paths, "branch_contrast_B")
    per_doc = paths.with_columns(u=u).group_by("doc_id").agg(pl.col("u").mean())
    assert abs(per_doc["u"].mean()) < 1e-12
    assert endpoint_path_values(paths, "C_H") is None
