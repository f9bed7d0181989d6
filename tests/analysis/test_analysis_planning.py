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
from kvdiverge.io.trajectories import (
    TRAJECTORY_SCHEMA,
    read_trajectories,
    read_trajectory_metadata,
    write_trajectories,
)


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
    assert design["cost"] <= brute + 1e-9


def test_evaluation_replicates_is_the_smallest_K_reaching_the_target():
    z = 1.959963984540054
    for sb2, sw2, n in [(0.001, 0.2, 400), (0.0, 0.1, 50), (0.002, 0.05, 300), (0.01, 0.1, 10)]:
        got = evaluation_replicates(sb2, sw2, n, half_width=0.01, max_K=500)
        reach = [k for k in range(1, 501) if z * math.sqrt((sb2 + sw2 / k) / n) <= 0.01]
        assert got == (reach[0] if reach else None)
    # σ_b²/n alone exceeds the target: no K suffices, more documents would be needed
    assert evaluation_replicates(0.01, 0.1, 10, half_width=0.01) is None


H = 16


def _dev_file(
    path, stratum: str, mus, K: int, seed: int, timing: dict | None, n_prompt: int = 10
) -> list:
    """A development trajectory file of documents with per-step mismatch probabilities ``mus``
    (K paths each, H steps, ``n_prompt`` prompt tokens); returns each path's D_H by document."""
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
        n_prompt=pl.lit(n_prompt),
        n_kept=pl.lit(max(1, n_prompt // 2)),
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


def _study_files(tmp_path, n_prompt: int, seconds: float = 1.0, mus=None, K=4) -> dict:
    """Development files of model m, actions snap/recent/full and strata s1, s2, with
    ``n_prompt`` prompt tokens per document and measured seconds = docs·20·``seconds`` and
    paths·0.05·``seconds``."""
    mus = mus or {"s1": [0.1, 0.3, 0.5, 0.2], "s2": [0.6, 0.4, 0.8, 0.7]}
    files = {}
    for a, action in enumerate(["snap", "recent", "full"]):
        for stratum, values in mus.items():
            k = 2 if action == "full" else K
            timing = {
                "documents": len(values),
                "paths": len(values) * k,
                "prefill_seconds": 15.0 * len(values) * seconds,
                "selection_seconds": 5.0 * len(values) * seconds,
                "decode_seconds": 0.05 * len(values) * k * seconds,
            }
            path = tmp_path / f"{action}-{stratum}.parquet"
            values = [0.0] * len(values) if action == "full" else values
            _dev_file(path, stratum, values, k, 10 * a + len(files), timing, n_prompt)
            files[("m", action, stratum)] = path
    return files


def _row_steps(path) -> float:
    """2H + (H − τ)+ averaged over a file's paths, computed from its rows."""
    frame = pl.read_parquet(path).sort("doc_id", "replicate", "t")
    tau = frame.group_by("doc_id", "replicate").agg(
        tau=pl.when(pl.col("mismatch").any())
        .then(pl.col("t").filter(pl.col("mismatch")).min())
        .otherwise(H + 1)
    )
    return float((2 * H + (H - tau["tau"]).clip(0, None)).mean())


def test_study_plan_reads_everything_from_the_development_files(tmp_path):
    """c_doc (prompt tokens) and c_rep (row-steps per replicate) come from each action's own
    rows, and so do the variances; with documents expensive and replicates cheap the
    least-cost design runs many replicates per document, near K* = sqrt(c_doc σ_w² / (c_rep
    σ_b²)); the study's K is the largest K the pairs need, every pair reports its design at
    that K, and the measured seconds are kept beside, unused."""
    files = _study_files(tmp_path, n_prompt=4000)
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
    assert {e["estimand"] for e in plan["plans"]} == {"R_smc"} and plan["level"] == 0.95
    assert plan["strata"] == ["s1", "s2"] and plan["K_source"] == "plan"
    assert plan["cost_units"] == "tokens"
    for entry in plan["plans"]:
        action = entry["action"]
        rows = pl.concat([development_moments(files[("m", action, s)], s) for s in ("s1", "s2")])
        assert entry["sigma_within2"] == pytest.approx(variance_components(rows)["sigma_within2"])
        assert entry["K_dev"] == 4
        assert entry["c_doc"] == 4000
        steps = [_row_steps(files[("m", action, s)]) for s in ("s1", "s2")]
        assert entry["c_rep"] == pytest.approx(sum(steps) / 2)  # equal paths per stratum
        if entry["sigma_between2"] > 0:
            ratio = entry["c_doc"] * entry["sigma_within2"]
            ratio /= entry["c_rep"] * entry["sigma_between2"]
            assert entry["K_continuous"] == pytest.approx(math.sqrt(ratio))
        assert entry["K_needed"] == evaluation_replicates(
            entry["sigma_between2"], entry["sigma_within2"], 800, 0.02, max_K=64
        )
        evaluation = entry["evaluation"]
        assert evaluation["K"] == plan["K"] and evaluation["n_docs"] == 800
        assert evaluation["cost"] == pytest.approx(
            800 * (entry["c_doc"] + plan["K"] * entry["c_rep"])
        )
    assert (
        plan["K"]
        == plan["K_planned"]
        == max(e["K_needed"] if e["K_needed"] is not None else e["K"] for e in plan["plans"])
    )
    binding = plan["binding"]
    assert binding["K"] == plan["K_planned"] and binding["estimand"] == "R_smc"
    measured = {(m["model"], m["action"]): m["seconds"] for m in plan["measured"]["pairs"]}
    assert measured[("m", "snap")] == pytest.approx({"c_doc": 20.0, "c_rep": 0.05})
    assert plan["measured"]["used"] is False
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


def _rescale_timing(path, factor: float) -> None:
    """Rewrite a trajectory file with its measured seconds multiplied by ``factor``."""
    frame, meta = read_trajectories(path), read_trajectory_metadata(path)
    timing = dict(meta["timing"])
    for key in ("prefill_seconds", "selection_seconds", "decode_seconds"):
        timing[key] *= factor
    write_trajectories(frame, path, {**meta, "timing": timing})


def test_scaling_the_recorded_timings_changes_no_planned_K(tmp_path):
    """Issue 27 item 5: the cost model counts tokens and row-steps, so a machine 1.6 times
    slower (every recorded second × 1.6) plans the same design; only the seconds kept for
    information change."""
    files = _study_files(tmp_path, n_prompt=4000)
    common = dict(
        actions=["snap", "recent", "full"], control="full", documents_per_stratum=2,
        cohort="study2", half_width=0.01, max_K=512,
    )  # fmt: skip
    before = study_plan(files, **common)
    for path in files.values():
        _rescale_timing(path, 1.6)
    after = study_plan(files, **common)
    assert after["K"] == before["K"] and after["K_planned"] == before["K_planned"] > 1
    assert {k: v for k, v in after.items() if k != "measured"} == {
        k: v for k, v in before.items() if k != "measured"
    }
    was = before["measured"]["pairs"][0]["seconds"]
    now = after["measured"]["pairs"][0]["seconds"]
    assert now["c_doc"] == pytest.approx(1.6 * was["c_doc"])


def test_a_development_file_with_one_path_per_document_is_refused(tmp_path):
    """K_dev = 1 gives σ_w² = 0 and always K = 1: the plan refuses such a file in one line."""
    path = tmp_path / "one.parquet"
    _dev_file(path, "s1", [0.1, 0.5, 0.9], 1, 0, None)
    files = {("m", "snap", "s1"): path, ("m", "full", "s1"): path}
    with pytest.raises(PlanningError) as info:
        study_plan(
            files, actions=["snap", "full"], control="full", documents_per_stratum=2,
            cohort="study1",
        )  # fmt: skip
    assert str(info.value) == (
        f"{path}: 3 development document(s) have one path each (e.g. 's1/dev/000'); the plan "
        "needs K_dev >= 2 paths per document to estimate the within-document variance"
    )


def test_too_few_documents_is_one_note_and_the_least_cost_K(tmp_path):
    """The config fixes 2 documents per stratum, far too few for ±0.01: no K suffices, the
    study runs the least-cost K, and one line says how many documents the target needs; a
    bound below the least-cost K is said too; a pinned K is used as it is."""
    files = _study_files(tmp_path, n_prompt=4000)
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
    """The reverse regime: a one-token prompt costs little beside a replicate's 2H row-steps,
    so K = 1 is least cost."""
    files = _study_files(tmp_path, n_prompt=1)
    plan = study_plan(
        files, actions=["snap", "full"], control="full", documents_per_stratum=2,
        cohort="study1", half_width=0.02,
    )  # fmt: skip
    assert plan["plans"][0]["c_doc"] == 1 and plan["plans"][0]["K"] == 1


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
    with pytest.raises(PlanningError, match=r"junk\.parquet: not a readable"):
        read_timing(tmp_path / "junk.parquet")
    with pytest.raises(PlanningError, match=r"junk\.parquet: not a readable"):
        development_moments(tmp_path / "junk.parquet", "s1")
