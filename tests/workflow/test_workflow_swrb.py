"""End to end under ``rollout.coupling: swrb`` (docs/swrb.md, "Switching it on"): the
development rollouts (shared-reference), plan and lock, the SWRB evaluation job, the SWRB
estimands table and its divergence CDF figures, on one tiny demo model, one stratum and H = 8,
at decoding temperature T = 0.5 (``rollout.temperature``: the lock, the development trajectories
and the SWRB record files carry it).
The table's values are recomputed here from the raw record files with the closed forms
(M = 1 − Π_s(1 − e_s), P(τ ≤ t | U) = 1 − Π_{s≤t}(1 − e_s)), not with the analysis code."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import yaml
from workflow_helpers import ROOT, place_fixture_documents, run_snakemake, workflow_copy

from kvdiverge.analysis.prespecification import read_lock
from kvdiverge.io.swrb_records import read_swrb_metadata, read_swrb_records
from kvdiverge.io.trajectories import read_trajectory_metadata

H = 8
T = 0.5
ACTIONS = ["snapkv-half", "recent-half", "full"]
RULES = [
    "dev_rollout_study1",
    "plan_sample_sizes",
    "prespecify",
    "rollout_study1",
    "swrb_estimands",
    "swrb_figures",
]


def _config() -> dict:
    """configs/tiny.yaml cut down: tiny-llama, the fixture's stratum, study 1 with three
    actions and a pinned K = 2, H = 8, ``rollout.coupling: swrb`` at ``rollout.temperature``
    0.5."""
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    config["models"] = {"tiny-llama": config["models"]["tiny-llama"]}
    config["datasets"]["strata"] = [{"env": "ruler", "label": "1024", "target_tokens": 1024}]
    config["datasets"]["cohorts"] = {"dev": 2, "study1": 3}
    config["studies"] = {
        "study1": {
            "actions": ACTIONS,
            "K": 2,
            "K_dev": 2,
            "K_control": 2,
            "bootstrap_draws": 2000,
        }
    }
    config["rollout"].update(H=H, coupling="swrb", temperature=T)
    config["analysis"]["contrasts"] = {"study1": [["recent-half", "snapkv-half"]]}
    config["analysis"]["prediction"]["pairs"] = {}
    return config


def _document_values(path) -> pl.DataFrame:
    """Per document, from the raw records: mean over replicates of M·D (R_SMC), M/H (O_H)
    and P(τ ≤ t | U) at t = 2 and t = H."""
    frame = read_swrb_records(path)
    e = np.array(frame["e"].to_list())
    mismatch = np.array(frame["x_token"].to_list()) != np.array(frame["y_token"].to_list())
    survive = np.cumprod(1.0 - e, axis=1)
    M = 1.0 - survive[:, -1]
    return (
        pl.DataFrame(
            {
                "doc_id": frame["doc_id"],
                "R_smc": M * mismatch.mean(1),
                "O_H": M / H,
                "div_cdf@2": 1.0 - survive[:, 1],
                f"div_cdf@{H}": 1.0 - survive[:, -1],
            }
        )
        .group_by("doc_id")
        .mean()
        .sort("doc_id")
    )


@pytest.mark.slow
def test_swrb_coupling_runs_from_the_config_to_the_tables(tmp_path):
    work = workflow_copy(tmp_path)
    (work / "config.yaml").write_text(yaml.safe_dump(_config(), sort_keys=False))
    place_fixture_documents(work)
    targets = [
        "results/study1/tables/swrb_estimands.csv",
        "results/study1/figures/swrb_divergence_cdf.png",
        "results/study1/figures/swrb_divergence_cdf_strata.png",
    ]
    res = run_snakemake(work, *targets, "--allowed-rules", *RULES, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for name in ("tables/swrb_estimands.md", *(t.split("study1/")[1] for t in targets)):
        assert (work / "results" / "study1" / name).stat().st_size > 0
    assert (work / "results/study1/figures/swrb_divergence_cdf.pdf").exists()

    lock = read_lock(work / "results/study1/lock.json")
    assert lock["design"]["coupling"] == "swrb" and lock["design"]["K"] == 2
    assert lock["design"]["temperature"] == T
    records = {a: work / f"results/study1/tiny-llama/swrb/{a}/ruler-1024.parquet" for a in ACTIONS}
    study_docs = ["ruler-1024/study1/000", "ruler-1024/study1/001", "ruler-1024/study1/002"]
    values = {}
    for action, path in records.items():
        meta = read_swrb_metadata(path)
        assert meta["coupling"] == "swrb" and meta["lock"] == lock["hash"]
        assert meta["temperature"] == T
        assert meta["K"] == {"study1": 2} and meta["H"] == H and meta["n_documents"] == 3
        dev = work / f"results/study1/tiny-llama/dev/trajectories/{action}/ruler-1024.parquet"
        dev_meta = read_trajectory_metadata(dev)
        assert dev_meta["coupling"] == "shared-reference" and dev_meta["temperature"] == T
        values[action] = _document_values(path)
        assert values[action]["doc_id"].to_list() == study_docs
    assert (values["recent-half"]["O_H"] > 0).all()  # evicting half the prompt diverges

    table = pl.read_csv(work / "results/study1/tables/swrb_estimands.csv")
    assert set(table["stratum"]) == {"pooled", "ruler-1024"}

    def row(estimand, action="", contrast="", stratum="pooled"):
        rows = table.filter(
            (pl.col("estimand") == estimand)
            & (pl.col("action").fill_null("") == action)
            & (pl.col("contrast").fill_null("") == contrast)
            & (pl.col("stratum") == stratum)
        )
        assert rows.height == 1, (estimand, action, contrast, stratum)
        return rows.row(0, named=True)

    for action in ACTIONS:
        for estimand in ("R_smc", "O_H", "div_cdf@2", f"div_cdf@{H}"):
            expected = values[action][estimand].mean()  # documents weigh equally
            for stratum in ("pooled", "ruler-1024"):  # one stratum: the same rows
                got = row(estimand, action, stratum=stratum)
                assert got["value"] == pytest.approx(expected, rel=1e-9, abs=1e-12)
                assert got["n_docs"] == 3 and got["n_paths"] == 6
                assert got["ci_low"] <= got["ci_high"]
    contrast = row("O_H", contrast="recent-half - snapkv-half")
    expected = (values["recent-half"]["O_H"] - values["snapkv-half"]["O_H"]).mean()
    assert contrast["value"] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    entry = row("mean_entry_time", "recent-half")
    assert 1 <= entry["value"] <= H
