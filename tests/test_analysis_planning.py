"""Sample-size planning from development variance and measured cost."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from kvdiverge.analysis.document_stats import AnalysisInputError
from kvdiverge.analysis.planning import (
    cost_from_timing,
    optimal_design,
    read_timing,
    study_plan,
    variance_components,
)
from kvdiverge.trajectories import TRAJECTORY_SCHEMA, write_trajectories


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


def test_cost_from_timing_divides_summed_seconds_by_documents_and_paths():
    timings = [
        {"documents": 10, "paths": 320, "prefill_seconds": 30.0, "selection_seconds": 5.0,
         "decode_seconds": 80.0},
        {"documents": 12, "paths": 400, "prefill_seconds": 40.0, "selection_seconds": 2.0,
         "decode_seconds": 100.0},
    ]  # fmt: skip
    got = cost_from_timing(timings)
    assert got["c_doc"] == pytest.approx((30 + 5 + 40 + 2) / 22)
    assert got["c_rep"] == pytest.approx(180 / 720)
    with pytest.raises(AnalysisInputError, match="no documents or no paths"):
        cost_from_timing([{**timings[0], "documents": 0}])


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


def _trajectory_file(path, timing: dict | None) -> None:
    """An (empty) trajectory file whose metadata carries ``timing`` (None: no such key)."""
    meta = {
        "model": "m", "revision": None, "action": {"name": "a"}, "H": 4, "K": 2, "seed": 0,
        "coupling": "shared-reference", "dtype": "float32", "device": "cpu",
    }  # fmt: skip
    if timing is not None:
        meta["timing"] = timing
    write_trajectories(pl.DataFrame(schema=TRAJECTORY_SCHEMA), path, meta)


def _study_stats(sigma_b: float, sigma_w: float) -> dict[str, pl.DataFrame]:
    dev = _dev_stats(sigma_b, sigma_w, 60, 16, 1)
    evaluation = dev.with_columns(
        cohort=pl.lit("study1"), doc_id=pl.col("doc_id").str.replace("/dev/", "/study1/")
    )
    snap = pl.concat([dev, evaluation])
    control = snap.with_columns(action=pl.lit("full"), n_paths=pl.lit(2, dtype=pl.Int64))
    return {"m": pl.concat([snap, snap.with_columns(action=pl.lit("recent")), control])}


def _timing_files(tmp_path, stats, c_doc: float, c_rep: dict[str, float]) -> dict:
    """One file per (model, action, stratum) with seconds = docs·c_doc, paths·c_rep[action]."""
    files = {}
    for (action, stratum), frame in stats["m"].group_by("action", "stratum"):
        docs, paths = frame.height, int(frame["n_paths"].sum())
        timing = {
            "documents": docs,
            "paths": paths,
            "prefill_seconds": 0.75 * docs * c_doc,
            "selection_seconds": 0.25 * docs * c_doc,
            "decode_seconds": paths * c_rep[action],
        }
        files[("m", action, stratum)] = tmp_path / f"{action}-{stratum}.parquet"
        _trajectory_file(files[("m", action, stratum)], timing)
    return files


def test_study_plan_reads_costs_from_trajectory_timing(tmp_path):
    """c_doc and c_rep come from each action's own timing metadata; with documents expensive
    and replicates cheap (c_doc·σ_w² ≫ c_rep·σ_b²) the plan runs many replicates per document,
    near the continuous optimum K* = sqrt(c_doc σ_w² / (c_rep σ_b²))."""
    stats = _study_stats(sigma_b=0.05, sigma_w=0.3)
    c_doc, c_rep = 20.0, {"snap": 0.05, "recent": 0.02, "full": 0.01}
    files = _timing_files(tmp_path, stats, c_doc, c_rep)
    plan = study_plan(
        stats,
        files,
        actions=["snap", "recent", "full"],
        control="full",
        half_width=0.01,
        configured_K=16,
        configured_docs=60,
    )
    assert [e["action"] for e in plan["plans"]] == ["snap", "recent"]
    for entry in plan["plans"]:
        assert entry["c_doc"] == pytest.approx(c_doc)
        assert entry["c_rep"] == pytest.approx(c_rep[entry["action"]])
        ratio = c_doc * entry["sigma_within2"] / (c_rep[entry["action"]] * entry["sigma_between2"])
        assert ratio > 100
        assert entry["K_continuous"] == pytest.approx(math.sqrt(ratio))
        assert entry["K"] > 1
        assert entry["half_width"] <= 0.01
        assert entry["configured"]["cost_seconds"] == pytest.approx(
            60 * (c_doc + 16 * c_rep[entry["action"]])
        )
    del files[("m", "recent", "s2")]
    with pytest.raises(AnalysisInputError, match=r"no trajectory file for \('m', 'recent', 's2'\)"):
        study_plan(stats, files, actions=["recent", "full"], control="full")


def test_cheap_documents_give_one_replicate(tmp_path):
    """The reverse regime: documents cost nothing of their own, so K = 1 is least cost."""
    stats = _study_stats(sigma_b=0.1, sigma_w=0.3)
    files = _timing_files(tmp_path, stats, 0.0, {"snap": 0.05, "recent": 0.05, "full": 0.01})
    plan = study_plan(stats, files, actions=["snap", "full"], control="full", half_width=0.02)
    assert plan["plans"][0]["c_doc"] == 0 and plan["plans"][0]["K"] == 1


def test_trajectory_file_without_timing_is_an_error(tmp_path):
    _trajectory_file(tmp_path / "old.parquet", None)
    with pytest.raises(
        AnalysisInputError, match=r"old\.parquet: trajectory metadata lacks 'timing'"
    ):
        read_timing(tmp_path / "old.parquet")
    _trajectory_file(tmp_path / "part.parquet", {"documents": 3, "paths": 6})
    with pytest.raises(AnalysisInputError, match=r"part\.parquet: timing lacks numeric field"):
        read_timing(tmp_path / "part.parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(AnalysisInputError, match=r"junk\.parquet: not a readable Parquet"):
        read_timing(tmp_path / "junk.parquet")
