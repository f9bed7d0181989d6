"""Sample-size planning from the development rollouts: variance, measured cost, and the
evaluation K for a fixed number of documents (docs/prespecification.md,
"Fixed by the development stage")."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from kvdiverge.analysis.planning import (
    PlanningError,
    cost_from_timing,
    development_moments,
    evaluation_replicates,
    optimal_design,
    read_timing,
    study_plan,
    variance_components,
)
from kvdiverge.io.trajectories import TRAJECTORY_SCHEMA, write_trajectories


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
    got = variance_components(stats)
    assert got["K_dev"] == 8
    assert got["sigma_within2"] == pytest.approx(0.09, rel=0.03)
    assert got["sigma_between2"] == pytest.approx(0.01, rel=0.15)
    with pytest.raises(PlanningError, match="snap: needs at least 2 development documents"):
        variance_components(stats.head(1), where="snap")
    one_each = stats.group_by("stratum").head(1)
    with pytest.raises(PlanningError, match="two development documents in some stratum"):
        variance_components(one_each)


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
    with pytest.raises(PlanningError, match="no documents or no paths"):
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


def test_evaluation_replicates_is_the_smallest_K_reaching_the_target():
    z = 1.959963984540054
    for sb2, sw2, n in [(0.001, 0.2, 400), (0.0, 0.1, 50), (0.002, 0.05, 300), (0.01, 0.1, 10)]:
        got = evaluation_replicates(sb2, sw2, n, half_width=0.01, max_K=500)
        reach = [k for k in range(1, 501) if z * math.sqrt((sb2 + sw2 / k) / n) <= 0.01]
        assert got == (reach[0] if reach else None)
    # σ_b²/n alone exceeds the target: no K suffices, more documents would be needed
    assert evaluation_replicates(0.01, 0.1, 10, half_width=0.01) is None


H = 16


def _dev_file(path, stratum: str, mus, K: int, seed: int, timing: dict | None) -> list:
    """A development trajectory file of documents with per-step mismatch probabilities ``mus``
    (K paths each, H steps); returns each path's D_H by document."""
    rng = np.random.default_rng(seed)
    rows, paths = [], []
    for i, mu in enumerate(mus):
        doc_id = f"{stratum}/dev/{i:03d}"
        steps = rng.random((K, H)) < mu
        paths.append(steps.mean(1))
        for r in range(K):
            for t in range(H):
                rows.append((doc_id, r, t + 1, int(steps[r, t])))
    frame = pl.DataFrame(
        rows, schema=["doc_id", "replicate", "t", "y_token"], orient="row"
    ).with_columns(
        x_token=pl.lit(0),
        mismatch=pl.col("y_token") != 0,
        tv_rollout=pl.lit(0.0),
        tv_fixed=pl.lit(0.0),
        x_eos=pl.lit(False),
        y_eos=pl.lit(False),
        n_prompt=pl.lit(10),
        n_kept=pl.lit(5),
    )
    meta = {
        "model": "m", "revision": None, "action": {"name": "a"}, "H": H, "K": {"dev": K},
        "seed": 0, "coupling": "shared-reference", "dtype": "float32", "device": "cpu",
        "n_documents": len(mus),
    }  # fmt: skip
    if timing is not None:
        meta["timing"] = timing
    write_trajectories(frame.select(list(TRAJECTORY_SCHEMA)), path, meta)
    return paths


def test_development_moments_are_the_replicate_means_of_d_and_d_squared(tmp_path):
    paths = _dev_file(tmp_path / "f.parquet", "s1", [0.1, 0.5, 0.9], 4, 0, None)
    got = development_moments(tmp_path / "f.parquet", "s1")
    assert got["doc_id"].to_list() == [f"s1/dev/{i:03d}" for i in range(3)]
    assert (got["n_paths"] == 4).all() and (got["stratum"] == "s1").all()
    assert np.allclose(got["mismatch"], [p.mean() for p in paths])
    assert np.allclose(got["mismatch_sq"], [(p**2).mean() for p in paths])


def _study_files(tmp_path, c_doc: float, c_rep: dict[str, float], mus=None, K=4) -> dict:
    """Development files of model m, actions snap/recent/full and strata s1, s2, with
    seconds = docs·c_doc and paths·c_rep[action]."""
    mus = mus or {"s1": [0.1, 0.3, 0.5, 0.2], "s2": [0.6, 0.4, 0.8, 0.7]}
    files = {}
    for a, action in enumerate(["snap", "recent", "full"]):
        for stratum, values in mus.items():
            k = 2 if action == "full" else K
            timing = {
                "documents": len(values),
                "paths": len(values) * k,
                "prefill_seconds": 0.75 * len(values) * c_doc,
                "selection_seconds": 0.25 * len(values) * c_doc,
                "decode_seconds": len(values) * k * c_rep[action],
            }
            path = tmp_path / f"{action}-{stratum}.parquet"
            values = [0.0] * len(values) if action == "full" else values
            _dev_file(path, stratum, values, k, 10 * a + len(files), timing)
            files[("m", action, stratum)] = path
    return files


def test_study_plan_reads_everything_from_the_development_files(tmp_path):
    """c_doc and c_rep come from each action's own timing metadata and the variances from the
    files' rows; with documents expensive and replicates cheap the least-cost design runs many
    replicates per document, near K* = sqrt(c_doc σ_w² / (c_rep σ_b²)); the study's K is the
    largest K the pairs need, and every pair reports its design at that K."""
    c_doc, c_rep = 20.0, {"snap": 0.05, "recent": 0.02, "full": 0.01}
    files = _study_files(tmp_path, c_doc, c_rep)
    plan = study_plan(
        files,
        actions=["snap", "recent", "full"],
        control="full",
        documents_per_stratum=400,
        cohort="study1",
        half_width=0.02,
        max_K=64,
    )
    assert [e["action"] for e in plan["plans"]] == ["snap", "recent"]
    assert plan["strata"] == ["s1", "s2"] and plan["K_source"] == "plan"
    for entry in plan["plans"]:
        action = entry["action"]
        rows = pl.concat([development_moments(files[("m", action, s)], s) for s in ("s1", "s2")])
        assert entry["sigma_within2"] == pytest.approx(variance_components(rows)["sigma_within2"])
        assert entry["K_dev"] == 4
        assert entry["c_doc"] == pytest.approx(c_doc)
        assert entry["c_rep"] == pytest.approx(c_rep[action])
        if entry["sigma_between2"] > 0:
            ratio = c_doc * entry["sigma_within2"] / (c_rep[action] * entry["sigma_between2"])
            assert entry["K_continuous"] == pytest.approx(math.sqrt(ratio))
        assert entry["K_needed"] == evaluation_replicates(
            entry["sigma_between2"], entry["sigma_within2"], 800, 0.02, max_K=64
        )
        evaluation = entry["evaluation"]
        assert evaluation["K"] == plan["K"] and evaluation["n_docs"] == 800
        assert evaluation["cost_seconds"] == pytest.approx(
            800 * (c_doc + plan["K"] * c_rep[action])
        )
    assert (
        plan["K"]
        == plan["K_planned"]
        == max(e["K_needed"] if e["K_needed"] is not None else e["K"] for e in plan["plans"])
    )
    if all(e["evaluation"]["half_width"] <= 0.02 for e in plan["plans"]):
        assert plan["notes"] == []
    del files[("m", "recent", "s2")]
    with pytest.raises(
        PlanningError, match=r"no development trajectory file for \('m', 'recent', 's2'\)"
    ):
        study_plan(
            files, actions=["recent", "full"], control="full", documents_per_stratum=4,
            cohort="study1",
        )  # fmt: skip


def test_too_few_documents_is_one_note_and_the_least_cost_K(tmp_path):
    """The config fixes 2 documents per stratum, far too few for ±0.01: no K suffices, the
    study runs the least-cost K, and one line says how many documents the target needs; a
    bound below the least-cost K is said too; a pinned K is used as it is."""
    files = _study_files(tmp_path, 20.0, {"snap": 0.05, "recent": 0.05, "full": 0.01})
    common = dict(
        actions=["snap", "recent", "full"], control="full", documents_per_stratum=2,
        cohort="study2", half_width=0.01,
    )  # fmt: skip
    plan = study_plan(files, **common, max_K=512)
    assert all(e["K_needed"] is None for e in plan["plans"])
    assert plan["K"] == max(e["K"] for e in plan["plans"]) > 1
    (note,) = plan["notes"]
    assert note.startswith(f"more documents would be needed: at K = {plan['K']}, a half-width")
    assert "the config fixes 2 (datasets.cohorts.study2)" in note and "\n" not in note
    need = max(e["evaluation"]["docs_per_stratum_needed"] for e in plan["plans"])
    assert f"needs {need} evaluation documents per stratum" in note and need > 2

    bounded = study_plan(files, **common, max_K=2)
    assert bounded["K"] == 2
    assert bounded["notes"][1].startswith("K is bounded by analysis.planning.max_K = 2")

    pinned = study_plan(files, **common, max_K=512, pinned_K=3)
    assert pinned["K"] == 3 and pinned["K_source"] == "config"
    assert pinned["K_planned"] == plan["K"]
    assert all(e["evaluation"]["K"] == 3 for e in pinned["plans"])


def test_cheap_documents_give_one_replicate(tmp_path):
    """The reverse regime: documents cost nothing of their own, so K = 1 is least cost."""
    files = _study_files(tmp_path, 0.0, {"snap": 0.05, "recent": 0.05, "full": 0.01})
    plan = study_plan(
        files, actions=["snap", "full"], control="full", documents_per_stratum=2,
        cohort="study1", half_width=0.02,
    )  # fmt: skip
    assert plan["plans"][0]["c_doc"] == 0 and plan["plans"][0]["K"] == 1


def _timing_only_file(path, timing: dict | None) -> None:
    """An (empty) trajectory file whose metadata carries ``timing`` (None: no such key)."""
    meta = {
        "model": "m", "revision": None, "action": {"name": "a"}, "H": 4, "K": 2, "seed": 0,
        "coupling": "shared-reference", "dtype": "float32", "device": "cpu",
    }  # fmt: skip
    if timing is not None:
        meta["timing"] = timing
    write_trajectories(pl.DataFrame(schema=TRAJECTORY_SCHEMA), path, meta)


def test_trajectory_file_without_timing_is_an_error(tmp_path):
    _timing_only_file(tmp_path / "old.parquet", None)
    with pytest.raises(PlanningError, match=r"old\.parquet: trajectory metadata lacks 'timing'"):
        read_timing(tmp_path / "old.parquet")
    _timing_only_file(tmp_path / "part.parquet", {"documents": 3, "paths": 6})
    with pytest.raises(PlanningError, match=r"part\.parquet: timing lacks numeric field"):
        read_timing(tmp_path / "part.parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(PlanningError, match=r"junk\.parquet: not a readable Parquet"):
        read_timing(tmp_path / "junk.parquet")
    with pytest.raises(PlanningError, match=r"junk\.parquet: not a readable Parquet"):
        development_moments(tmp_path / "junk.parquet", "s1")
