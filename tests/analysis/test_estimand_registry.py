"""One definition per estimand: the estimand and statistic registries are what the document
statistics, the estimands, the plan, the tables and the README's glossary read. A toy estimand
registered here (the share of steps with TV > 0.5) appears in every one of them, checked
against values computed from the trajectory files directly."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from kvdiverge.analysis.document_stats import document_stats, stat_columns
from kvdiverge.analysis.estimand_registry import (
    ESTIMANDS,
    Estimand,
    glossary_table,
    mean_endpoints,
    register_estimand,
)
from kvdiverge.analysis.estimands import RATIO_DENOMINATORS, action_estimands, estimands_table
from kvdiverge.analysis.planning import development_paths, endpoint_path_values
from kvdiverge.analysis.statistic_registry import STATISTICS, Clock, Statistic, register_statistic
from kvdiverge.analysis.synthetic import stratum_pairs, write_synthetic_study
from kvdiverge.tables.summary import estimands_summary, tidy_estimands

ROOT = Path(__file__).resolve().parents[2]
ACTIONS = ["full", "mild", "strong"]
LAMBDAS = {"full": 0.0, "mild": 0.3, "strong": 0.7}
H = 16

TOY_STATISTIC = Statistic(
    "tv_above_half", "(1/H) Σ_t 1{δ_t > 0.5}", lambda p: (p.delta > 0.5).sum(1) / p.H
)
TOY = Estimand(
    "S_50",
    "S_.5",
    "share of steps with δ_t > .5",
    "lower",
    "risks",
    ("tv_above_half",),
    "mean",
    "tv_above_half",
    lambda m, c, n, o: m["tv_above_half"],
    mean_of="tv_above_half",
)


@pytest.fixture
def toy():
    """The toy statistic and estimand registered for one test, the registries restored after."""
    saved = dict(STATISTICS), dict(ESTIMANDS)
    register_statistic(TOY_STATISTIC)
    register_estimand(TOY)
    yield
    for registry, before in zip((STATISTICS, ESTIMANDS), saved, strict=True):
        registry.clear()
        registry.update(before)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    pairs = {s: stratum_pairs(300 + i, LAMBDAS) for i, s in enumerate(["ruler-a", "helmet-b"])}
    return write_synthetic_study(
        root, "study1", "m", pairs, {"study1": (5, 3)}, H=H, seed=3, control="full"
    )


def _share_above_half(path) -> pl.DataFrame:
    """Per document of a trajectory file: the replicate mean of the per-path share of steps
    with δ_t > 0.5, straight from the file."""
    frame = pl.read_parquet(path)
    per_path = frame.group_by("doc_id", "replicate").agg(
        share=(pl.col("tv_rollout") > 0.5).sum() / H
    )
    return per_path.group_by("doc_id").agg(pl.col("share").mean())


def test_a_registered_estimand_reaches_every_reader(toy, study, tmp_path):
    files = {a: list(study[a].values()) for a in ACTIONS}
    stats, clock = document_stats(files, list(study["documents"].values()), control="full")
    # the document statistics: its column, last, with each document's value from the file
    assert stat_columns(clock)[-1] == "tv_above_half"
    for action in ACTIONS:
        want = pl.concat([_share_above_half(p) for p in files[action]])
        got = stats.filter(pl.col("action") == action).join(want, on="doc_id")
        assert got.height == want.height > 0
        assert np.array_equal(got["tv_above_half"].to_numpy(), got["share"].to_numpy())
    # the estimands: per action the document average, per contrast the difference
    table = estimands_table(stats, clock, model="m", actions=ACTIONS, draws=50, control="full")
    pooled = table.filter((pl.col("stratum") == "pooled") & (pl.col("estimand") == "S_50"))
    doc_mean = {
        a: float(stats.filter(pl.col("action") == a)["tv_above_half"].mean()) for a in ACTIONS
    }
    by_action = {
        r["action"]: r for r in pooled.filter(pl.col("action") != "").iter_rows(named=True)
    }
    assert set(by_action) == set(ACTIONS)
    for a in ACTIONS:
        assert by_action[a]["value"] == pytest.approx(doc_mean[a], abs=1e-12)
    (contrast,) = pooled.filter(pl.col("contrast") != "").iter_rows(named=True)
    assert contrast["contrast"] == "mild - strong"  # b - a over the compared actions in order
    assert contrast["value"] == pytest.approx(doc_mean["mild"] - doc_mean["strong"], abs=1e-12)
    assert doc_mean["strong"] > doc_mean["full"] == 0.0  # the toy can tell the actions apart
    # the tables: the summary's glossary and the typed copy carry it with its description
    summary = estimands_summary(table, "study1")
    assert ("S_50", "share of steps with δ_t > .5") in summary.glossary
    assert "S_50" in tidy_estimands(table)["estimand"].to_list()
    # the plan: a mean estimand is planned on its own path statistic
    assert mean_endpoints()["S_50"] == "tv_above_half"
    paths = development_paths(files["strong"][0], "ruler-a")
    values = endpoint_path_values(paths, "S_50")
    frame = pl.read_parquet(files["strong"][0]).sort("doc_id", "replicate", "t")
    direct = (frame["tv_rollout"].to_numpy().reshape(-1, H) > 0.5).sum(1) / H
    assert np.array_equal(values.to_numpy(), direct)


def test_registering_a_bad_estimand_is_refused_in_one_line(toy):
    with pytest.raises(ValueError, match="estimand 'S_50' is already registered"):
        register_estimand(TOY)
    with pytest.raises(ValueError, match=r"statistic 'tv_above_half' is already registered"):
        register_statistic(TOY_STATISTIC)
    unknown = Estimand(
        "S_x", "x", "x", "lower", "risks", ("nowhere",), "mean", "nowhere", TOY.compute
    )
    with pytest.raises(
        ValueError, match=r"estimand 'S_x': reads unregistered statistic\(s\) nowhere"
    ):
        register_estimand(unknown)
    with pytest.raises(ValueError, match="estimand 'S_y': better must be one of"):
        register_estimand(Estimand("S_y", "y", "y", "up", "risks", (), "mean", "", TOY.compute))
    with pytest.raises(ValueError, match="estimand 'S_z': an action estimand needs its compute"):
        register_estimand(Estimand("S_z", "z", "z", "lower", "risks", (), "mean", ""))
    with pytest.raises(ValueError, match="a column is a name without '@'"):
        register_statistic(Statistic("a@1", "", TOY_STATISTIC.compute))


def test_the_estimands_follow_the_registry():
    """Every action entry computes its column (a profile its columns), in registry order; the
    statistics an entry reads exist; the ratio denominators are the registry's."""
    clock = Clock.for_horizon(16)
    rng = np.random.default_rng(0)
    means = {c: rng.uniform(0.1, 0.9, 2) for c in stat_columns(clock)}
    means |= {c: rng.uniform(0.1, 0.9, 2) for c in ("cohort_any", "cohort_paths", "n_paths")}
    out = action_estimands(means, clock, 10)
    stems = list(dict.fromkeys(k.split("@")[0] for k in out))
    action = [e.column for e in ESTIMANDS.values() if e.computed_by == "action"]
    assert stems == action
    for e in ESTIMANDS.values():
        assert (e.profile is not None) == any(k.startswith(f"{e.column}@") for k in out)
        assert e.better in ("lower", "higher", "") and e.description
        if e.computed_by == "action":
            extra = ("cohort_any", "cohort_paths", "n_paths")
            assert all(s in STATISTICS or s in extra for s in e.statistics), e.column
    assert RATIO_DENOMINATORS == {
        "C_H": ((("exposure", 1.0),),),
        "mean_entry_time": ((("diverged", 1.0),),),
        "branch_early": ((("branch_cohort", 1.0),),),
        "branch_late": ((("branch_cohort", 1.0),),),
        "branch_contrast_B": ((("branch_cohort", 1.0),),),
        "local_agreement_run": ((("branch_cohort", 1.0),),),
        "local_reentry": ((("branch_cohort", 1.0),),),
        "pre_eos_share": ((("rollout_tv", 1.0), ("fixed_tv", -1.0)),),
        "eos_share": ((("rollout_tv", 1.0), ("fixed_tv", -1.0)),),
    }
    # a mean estimand is its statistic's document average, exactly
    for column, statistic in mean_endpoints().items():
        assert np.array_equal(out[column], means[statistic]), column


def test_the_readme_glossary_is_the_registry():
    """The README's glossary table ("| estimand (column name) | what it means | better |") is
    the registry's, row for row (regenerate it with
    ``kvdiverge.analysis.estimand_registry.glossary_table()``)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("| estimand (column name) | what it means | better |")
    block = re.match(r"(\|.*\|\n)+", readme[start:]).group(0).rstrip("\n")
    assert block == glossary_table()
    columns = re.findall(r"^\| [^|]*?\(`([^`]+)`\)", block, flags=re.M)
    for column in columns:
        entry = ESTIMANDS[column.split("@")[0]]
        assert entry.glossary is not None and entry.better, column


def test_the_analysis_docs_name_every_estimand():
    """`docs/analysis.md`, "Estimand names", names every estimand of the registry (a profile as
    ``stem@x``; ``rf_S0..rf_S3`` and ``*_share`` as written there)."""
    text = (ROOT / "docs" / "analysis.md").read_text(encoding="utf-8")
    start = text.index("\n## Estimand names\n")
    section = text[start : text.index("\n## ", start + 1)]
    names = {w.strip() for t in re.findall(r"`([^`]+)`", section) for w in t.split(",")}
    for first, last in [n.split("..") for n in names if ".." in n]:
        stem = first.rstrip("0123456789")
        names |= {f"{stem}{k}" for k in range(int(first[len(stem) :]), int(last[len(stem) :]) + 1)}
    suffixes = [n[1:] for n in names if n.startswith("*")]

    def named(e: Estimand) -> bool:
        if e.profile:
            return any(n.startswith(f"{e.column}@") for n in names)
        return e.column in names or any(e.column.endswith(s) for s in suffixes)

    missing = [e.column for e in ESTIMANDS.values() if e.computed_by != "accuracy" and not named(e)]
    assert not missing, f"docs/analysis.md, 'Estimand names', lacks {missing}"
