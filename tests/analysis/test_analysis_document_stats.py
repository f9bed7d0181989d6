"""Per-document statistics: hand-computed values and every input error."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from kvdiverge.analysis.document_stats import (
    AnalysisInputError,
    Clock,
    document_stats,
    path_statistics,
    read_document_stats,
    stat_columns,
    write_document_stats,
)
from kvdiverge.analysis.estimands import estimands_table
from kvdiverge.io.trajectories import write_trajectories

H = 8
CLOCK = Clock(H=8, branch_depth=4, window=2, blocks=((1, 4), (5, 8)), prefix=3, agreement_run=2)

# Path A: τ = 3, X emits EOS at t = 7, Y never. Path B: never diverges, both emit EOS at t = 2.
PATH_A = {
    "mismatch": [0, 0, 1, 0, 0, 1, 1, 0],
    "tv_rollout": [0, 0.1, 0.5, 0.6, 0.7, 0.995, 0.8, 0.9],
    "tv_fixed": [0, 0.1, 0.2, 0.2, 0.3, 0.3, 0.3, 0.3],
    "x_eos": [0, 0, 0, 0, 0, 0, 1, 1],
    "y_eos": [0] * 8,
}
PATH_B = {
    "mismatch": [0] * 8,
    "tv_rollout": [0, 0.2, 0, 0, 0, 0, 0, 0],
    "tv_fixed": [0, 0.2, 0, 0, 0, 0, 0, 0],
    "x_eos": [0, 1, 1, 1, 1, 1, 1, 1],
    "y_eos": [0, 1, 1, 1, 1, 1, 1, 1],
}

# Worked by hand from the definitions (see the module docstring's table).
EXPECTED_A = {
    "mismatch": 3 / 8,
    "mismatch_sq": 9 / 64,
    "diverged": 1,
    "tau_diverged": 3,
    "exposure": 5 / 8,
    "post_mismatch": 2 / 8,
    "rollout_tv": 4.595 / 8,
    "fixed_tv": 1.7 / 8,
    "saturation": 1 / 8,
    "branch_cohort": 1,
    "rf_seg0": 1.795 / 8,
    "rf_seg1": 0.5 / 8,
    "rf_seg2": 0.6 / 8,
    "rf_seg3": 0.0,
    "local_run": 1,
    "local_reentry": 1,
    "prefix_mismatch": 1 / 8,
    "prefix_diverged": 1,
    "prefix_x_eos": 0,
    "prefix_y_eos": 0,
    "prefix_fixed": 0.3 / 8,
    **{f"div_cdf@{t}": float(t >= 3) for t in range(1, 9)},
    **{f"delta@{t}": v for t, v in enumerate(PATH_A["tv_rollout"], start=1)},
    **{f"branch@{j}": v for j, v in enumerate([0.6, 0.7, 0.995, 0.8], start=1)},
    **{f"branch_pre@{j}": v for j, v in enumerate([0.6, 0.7, 0.995, 0.0], start=1)},
    **{f"branch_pre_n@{j}": v for j, v in enumerate([1, 1, 1, 0], start=1)},
}
EXPECTED_B = {
    **{k: 0.0 for k in EXPECTED_A},
    "rollout_tv": 0.2 / 8,
    "fixed_tv": 0.2 / 8,
    "delta@2": 0.2,
    "prefix_x_eos": 1,
    "prefix_y_eos": 1,
    "prefix_fixed": 0.2 / 8,
}


def _arrays(*paths):
    return [np.array([p[k] for p in paths], dtype=float) for k in PATH_A]


def test_path_statistics_match_hand_computation():
    got = path_statistics(*_arrays(PATH_A, PATH_B), CLOCK)
    names = stat_columns(CLOCK)
    assert got.shape == (2, len(names))
    for row, expected in ((got[0], EXPECTED_A), (got[1], EXPECTED_B)):
        for i, name in enumerate(names):
            assert row[i] == pytest.approx(expected[name], abs=1e-12), name


def test_local_agreement_needs_run_length_and_reentry_order():
    # after τ = 1: agree, mismatch, agree, agree (run 2, reentry) vs mismatch then agree only
    base = {"tv_rollout": [0.5] * 6, "tv_fixed": [0.1] * 6, "x_eos": [0] * 6, "y_eos": [0] * 6}
    clock = Clock(H=6, branch_depth=3, window=1, blocks=((1, 6),), prefix=2, agreement_run=2)
    a = {**base, "mismatch": [1, 0, 1, 0, 0, 1]}
    b = {**base, "mismatch": [1, 1, 0, 0, 0, 0]}
    got = path_statistics(*[np.array([a[k], b[k]], float) for k in PATH_A], clock)
    names = stat_columns(clock)
    run, reentry = got[:, names.index("local_run")], got[:, names.index("local_reentry")]
    assert run.tolist() == [1.0, 1.0]
    assert reentry.tolist() == [1.0, 0.0]


def _frame(doc_paths: dict[str, list[dict]], h: int = H) -> pl.DataFrame:
    rows = []
    for doc, paths in doc_paths.items():
        for rep, p in enumerate(paths):
            for t in range(h):
                rows.append(
                    {
                        "doc_id": doc,
                        "replicate": rep,
                        "t": t + 1,
                        "x_token": 0,
                        "y_token": int(p["mismatch"][t]),
                        "mismatch": bool(p["mismatch"][t]),
                        "tv_rollout": p["tv_rollout"][t],
                        "tv_fixed": p["tv_fixed"][t],
                        "x_eos": bool(p["x_eos"][t]),
                        "y_eos": bool(p["y_eos"][t]),
                        "n_prompt": 10,
                        "n_kept": 5,
                    }
                )
    return pl.DataFrame(rows)


def _meta(h: int = H, action: str = "x") -> dict:
    return {
        "model": "m",
        "revision": "r",
        "action": {"name": action},
        "H": h,
        "K": 2,
        "seed": 0,
        "coupling": "shared-reference",
        "dtype": "float32",
        "device": "cpu",
    }


DOCS = pl.DataFrame(
    {
        "doc_id": ["s-1/study1/000", "s-1/study1/001", "s-1/dev/000"],
        "stratum": ["s-1"] * 3,
        "cohort": ["study1", "study1", "dev"],
    }
)
SETTINGS = {"branch_depth": 0.5, "window": 0.25, "block_edges": [0.5], "prefix": 0.375}


def _write(tmp_path, name, doc_paths, h=H, action=None):
    """The trajectory file ``name`` of action ``action`` (default: its name)."""
    path = tmp_path / f"{name}.parquet"
    write_trajectories(_frame(doc_paths, h), path, _meta(h, action or name))
    return path


def test_document_stats_average_replicates_and_roundtrip(tmp_path):
    a = _write(tmp_path, "a", {"s-1/study1/000": [PATH_A, PATH_B], "s-1/study1/001": [PATH_B]})
    b = _write(tmp_path, "b", {"s-1/study1/000": [PATH_B], "s-1/study1/001": [PATH_A]})
    stats, clock = document_stats({"a": [a], "b": [b]}, DOCS, SETTINGS)
    assert clock == Clock(
        H=8, branch_depth=4, window=2, blocks=((1, 4), (5, 8)), prefix=3, agreement_run=1
    )
    row = stats.filter(action="a", doc_id="s-1/study1/000").row(0, named=True)
    assert row["n_paths"] == 2 and row["cohort"] == "study1" and row["stratum"] == "s-1"
    assert row["mismatch"] == pytest.approx(3 / 16)
    assert row["exposure"] == pytest.approx(5 / 16)
    assert row["branch@3"] == pytest.approx(0.995 / 2)
    assert row["cohort_paths"] == pytest.approx(1.0)
    out = tmp_path / "stats.parquet"
    write_document_stats(stats, out, clock)
    back, back_clock = read_document_stats(out)
    assert back_clock == clock and back.equals(stats)


def test_estimands_on_hand_table(tmp_path):
    """One document, action b = path A twice, action a = path B: ratios of document means."""
    a = _write(tmp_path, "a", {"s-1/study1/000": [PATH_B, PATH_B]})
    b = _write(tmp_path, "b", {"s-1/study1/000": [PATH_A, PATH_B]})
    stats, clock = document_stats({"a": [a], "b": [b]}, DOCS, SETTINGS)
    table = estimands_table(
        stats, clock, model="m", actions=["a", "b"], contrasts=[("b", "a")], draws=50, seed=0
    )
    got = {
        (r["action"] or r["contrast"], r["stratum"], r["estimand"]): r
        for r in table.iter_rows(named=True)
    }
    b_row = lambda name: got[("b", "pooled", name)]["value"]  # noqa: E731
    assert b_row("C_H") == pytest.approx((2 / 16) / (5 / 16))
    assert b_row("mean_entry_time") == pytest.approx(3.0)
    assert b_row("branch_tv@3") == pytest.approx(0.995)
    assert b_row("branch_early") == pytest.approx((0.6 + 0.7) / 2)
    assert b_row("branch_late") == pytest.approx((0.995 + 0.8) / 2)
    assert b_row("branch_pre_late") == pytest.approx(0.995)  # lag 4 is at EOS: left out
    assert b_row("block_tv@5:8") == pytest.approx((0.7 + 0.995 + 0.8 + 0.9 + 0) / 8)
    assert b_row("flat_extrapolation") == pytest.approx((1 / 2) / 3)
    assert b_row("branch_cohort_paths") == pytest.approx(1.0)
    assert b_row("S_99") == pytest.approx(1 / 16)
    assert got[("a", "pooled", "C_H")]["value"] != got[("a", "pooled", "C_H")]["value"]  # NaN
    c = lambda name: got[("b - a", "pooled", name)]["value"]  # noqa: E731
    assert c("R_smc") == pytest.approx(3 / 16)
    assert c("gap_occurrence") + c("gap_exposure") + c("gap_rate") == pytest.approx(3 / 16)
    assert c("pre_eos_share") == pytest.approx(
        (1.795 / 16) / ((4.595 - 1.7) / 16),
        rel=1e-6,  # float32 TVs
    )
    # one document: no interval exists (issue 28: "not available", never "v [v, v]")
    row = got[("b - a", "pooled", "R_smc")]
    assert row["value"] == pytest.approx(3 / 16)
    assert np.isnan(row["ci_low"]) and np.isnan(row["ci_high"])


def test_missing_column_names_the_file(tmp_path):
    path = tmp_path / "bad.parquet"
    _frame({"s-1/study1/000": [PATH_A]}).drop("tv_fixed").write_parquet(path)
    with pytest.raises(AnalysisInputError, match=r"bad\.parquet.*tv_fixed"):
        document_stats({"a": [path]}, DOCS)


def test_action_missing_documents_is_an_error(tmp_path):
    a = _write(tmp_path, "a", {"s-1/study1/000": [PATH_A], "s-1/study1/001": [PATH_A]})
    b = _write(tmp_path, "b", {"s-1/study1/000": [PATH_A]})
    with pytest.raises(
        AnalysisInputError, match=r"action 'b' lacks 1 document.*s-1/study1/001.*b\.parquet"
    ):
        document_stats({"a": [a], "b": [b]}, DOCS, SETTINGS)


def test_an_action_of_a_later_rollout_group_has_no_development_documents(tmp_path):
    """``development`` names the actions that ran the dev cohort (a study's first rollout
    group); another action covers the evaluation documents alone, and still all of them."""
    evaluation = {"s-1/study1/000": [PATH_A], "s-1/study1/001": [PATH_B]}
    a = _write(tmp_path, "a", {**evaluation, "s-1/dev/000": [PATH_A]})
    c = _write(tmp_path, "c", evaluation)
    with pytest.raises(AnalysisInputError, match=r"action 'c' lacks 1 document.*s-1/dev/000"):
        document_stats({"a": [a], "c": [c]}, DOCS, SETTINGS)
    stats, _ = document_stats({"a": [a], "c": [c]}, DOCS, SETTINGS, development=["a"])
    assert sorted(stats.filter(pl.col("action") == "c")["doc_id"]) == sorted(evaluation)
    part = _write(tmp_path, "part", {"s-1/study1/000": [PATH_A]})
    with pytest.raises(AnalysisInputError, match=r"action 'part' lacks 1 document.*study1/001"):
        document_stats({"a": [a], "part": [part]}, DOCS, SETTINGS, development=["a"])


def test_mismatched_horizon_is_an_error(tmp_path):
    short = {k: v[:6] for k, v in PATH_A.items()}
    a = _write(tmp_path, "a", {"s-1/study1/000": [PATH_A]})
    b = _write(tmp_path, "b6", {"s-1/study1/001": [short]}, h=6, action="a")
    with pytest.raises(AnalysisInputError, match=r"b6\.parquet: H = 6 differs from H = 8"):
        document_stats({"a": [a, b]}, DOCS, SETTINGS)


def test_incomplete_paths_and_unknown_documents(tmp_path):
    frame = _frame({"s-1/study1/000": [PATH_A]}).filter(pl.col("t") != 4)
    path = tmp_path / "gap.parquet"
    write_trajectories(frame, path, _meta(action="a"))
    with pytest.raises(AnalysisInputError, match=r"gap\.parquet: .*exactly one row for each t"):
        document_stats({"a": [path]}, DOCS, SETTINGS)
    other = _write(tmp_path, "other", {"x-9/study1/000": [PATH_A]}, action="a")
    with pytest.raises(AnalysisInputError, match=r"other\.parquet: doc_id 'x-9/study1/000'"):
        document_stats({"a": [other]}, DOCS, SETTINGS)


def test_empty_cohort_and_empty_stratum(tmp_path):
    a = _write(tmp_path, "a", {"s-1/study1/000": [PATH_A]})
    stats, clock = document_stats({"a": [a]}, DOCS, SETTINGS)
    with pytest.raises(
        AnalysisInputError, match=r"stats\.parquet: cohort 'study2' has no documents"
    ):
        estimands_table(
            stats, clock, model="m", actions=["a"], cohort="study2", where="stats.parquet"
        )
    with pytest.raises(
        AnalysisInputError, match=r"stats\.parquet: stratum 'ruler-4k' has no documents"
    ):
        estimands_table(
            stats,
            clock,
            model="m",
            actions=["a"],
            strata=["s-1", "ruler-4k"],
            where="stats.parquet",
        )
