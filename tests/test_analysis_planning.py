"""Sample-size planning from development variance and measured cost (SPEC §5)."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from kvdiverge.analysis.document_stats import AnalysisInputError
from kvdiverge.analysis.planning import (
    attribute_job_seconds,
    cost_per_unit,
    optimal_design,
    read_benchmark_seconds,
    study_plan,
    variance_components,
)

BENCH_HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


def _dev_stats(sigma_b: float, sigma_w: float, n_docs: int, K: int, seed: int) -> pl.DataFrame:
    """Document statistics of paths D = μ_doc + noise, μ_doc = stratum mean + N(0, σ_b²)."""
    rng = np.random.default_rng(seed)
    strata = np.repeat(["s1", "s2", "s3"], n_docs // 3)
    offset = {"s1": 0.2, "s2": 0.5, "s3": 0.7}
    mu = np.array([offset[s] for s in strata]) + rng.normal(0, sigma_b, strata.size)
    paths = mu[:, None] + rng.normal(0, sigma_w, (strata.size, K))
    return pl.DataFrame(
        {
            "doc_id": [f"{s}/dev/{i:04d}" for i, s in enumerate(strata)],
            "action": "snap",
            "stratum": strata,
            "cohort": "dev",
            "n_paths": np.full(strata.size, K),
            "mismatch": paths.mean(1),
            "mismatch_sq": (paths**2).mean(1),
        }
    )


def test_variance_components_recover_known_values():
    stats = _dev_stats(sigma_b=0.1, sigma_w=0.3, n_docs=3000, K=8, seed=0)
    got = variance_components(stats, "snap")
    assert got["K_dev"] == 8
    assert got["sigma_within2"] == pytest.approx(0.09, rel=0.03)
    assert got["sigma_between2"] == pytest.approx(0.01, rel=0.15)
    with pytest.raises(AnalysisInputError, match="action 'other' needs at least 2"):
        variance_components(stats, "other")


def test_cost_per_unit_solves_the_job_equations():
    c_doc, c_rep = 3.5, 0.25
    jobs = [
        {"docs": d, "paths": p, "seconds": d * c_doc + p * c_rep}
        for d, p in ((10, 320), (10, 20), (12, 400))
    ]
    got = cost_per_unit(jobs)
    assert got["c_doc"] == pytest.approx(c_doc) and got["c_rep"] == pytest.approx(c_rep)


def _brute_force(sb2, sw2, c_doc, c_rep, hw, z, n_strata, max_k=300):
    best = math.inf
    for k in range(1, max_k + 1):
        n = n_strata * math.ceil(math.ceil((z / hw) ** 2 * (sb2 + sw2 / k)) / n_strata)
        n = max(n, 2 * n_strata)  # optimal_design's default floor of 2 documents per stratum
        best = min(best, n * (c_doc + k * c_rep))
    return best


@pytest.mark.parametrize(
    "sb2, sw2, c_doc, c_rep",
    [(0.01, 0.09, 5.0, 0.1), (0.02, 0.02, 0.5, 0.5), (0.001, 0.2, 40.0, 0.05), (0.0, 0.1, 1, 1)],
)
def test_optimal_design_is_least_cost_and_reaches_the_target(sb2, sw2, c_doc, c_rep):
    z = 1.959963984540054
    design = optimal_design(sb2, sw2, c_doc, c_rep, half_width=0.01, level=0.95, n_strata=6)
    assert design["half_width"] <= 0.01 + 1e-12
    assert design["n_docs"] % 6 == 0
    brute = _brute_force(sb2, sw2, c_doc, c_rep, 0.01, z, 6, max_k=1024)
    assert design["cost_seconds"] <= brute + 1e-9


def _bench(path, seconds):
    path.write_text(BENCH_HEADER + f"{seconds}\t0:00:01\t100\t1\t1\t1\t0\t0\t50\t{seconds}\n")


def test_attribute_job_seconds_splits_by_paths_times_rows():
    paths = {"snap": 40, "recent": 40, "full": 20}
    rows = {"snap": 3, "recent": 3, "full": 1}
    shares = attribute_job_seconds(26.0, paths, rows)
    assert shares == pytest.approx({"snap": 12.0, "recent": 12.0, "full": 2.0})
    assert sum(shares.values()) == pytest.approx(26.0)
    with pytest.raises(AnalysisInputError, match="no decoded rows"):
        attribute_job_seconds(1.0, {"full": 0}, {"full": 1})


def test_study_plan_reads_job_benchmarks_and_compares_the_configured_design(tmp_path):
    """One benchmark per (model, stratum) job running every action; its seconds are the rows
    decoded × one per-row cost, so c_doc = 0 and c_rep = 3 × that cost (X, Y, Z rows)."""
    dev = _dev_stats(0.1, 0.3, 60, 16, 1)
    evaluation = dev.with_columns(
        cohort=pl.lit("study1"), doc_id=pl.col("doc_id").str.replace("/dev/", "/study1/")
    )
    snap = pl.concat([dev, evaluation])
    control = snap.with_columns(action=pl.lit("full"), n_paths=pl.lit(2, dtype=pl.Int64))
    recent = snap.with_columns(action=pl.lit("recent"))
    stats = {"m": pl.concat([snap, recent, control])}
    rows = {"snap": 3, "recent": 3, "full": 1}
    c_row = 0.02
    benchmarks = {}
    for (stratum,), frame in stats["m"].group_by("stratum"):
        paths = frame.group_by("action").agg(pl.col("n_paths").sum())
        seconds = sum(c_row * rows[a] * p for a, p in paths.iter_rows())
        path = tmp_path / f"{stratum}.tsv"
        _bench(path, seconds)
        benchmarks[("m", stratum)] = path
    plan = study_plan(
        stats,
        benchmarks,
        actions=["snap", "recent", "full"],
        control="full",
        half_width=0.02,
        configured_K=16,
        configured_docs=60,
    )
    assert [e["action"] for e in plan["plans"]] == ["snap", "recent"]
    entry = plan["plans"][0]
    assert entry["c_doc"] == pytest.approx(0.0, abs=1e-9)
    assert entry["c_rep"] == pytest.approx(3 * c_row)
    assert entry["half_width"] <= 0.02
    assert entry["K"] == 1  # documents cost nothing of their own: one replicate each
    assert entry["configured"]["K"] == 16
    assert entry["configured"]["cost_seconds"] == pytest.approx(60 * 16 * 3 * c_row)
    del benchmarks[("m", "s2")]
    with pytest.raises(AnalysisInputError, match=r"no rollout benchmark for \('m', 's2'\)"):
        study_plan(stats, benchmarks, actions=["snap", "full"], control="full")


def test_benchmark_without_seconds_is_an_error(tmp_path):
    path = tmp_path / "b.tsv"
    path.write_text("h:m:s\tmax_rss\n0:00:01\t3\n")
    with pytest.raises(AnalysisInputError, match=r"b\.tsv: benchmark TSV lacks the seconds"):
        read_benchmark_seconds(path)
