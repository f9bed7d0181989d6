"""The four analysis rules run by Snakemake on placed synthetic trajectories (no rollouts)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

from kvdiverge.analysis.synthetic import stratum_pairs, write_synthetic_study
from kvdiverge.config import validate_config
from kvdiverge.trajectories import read_trajectories, read_trajectory_metadata, write_trajectories

ROOT = Path(__file__).resolve().parents[1]
RULES = ["document_stats", "estimands", "prediction", "plan_sample_sizes"]


@pytest.mark.slow
def test_analysis_rules_on_synthetic_trajectories(tmp_path):
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    validate_config(config, ROOT / "workflow" / "schemas" / "config.schema.yaml")
    shutil.copy(ROOT / "configs" / "tiny.yaml", tmp_path / "config.yaml")
    shutil.copytree(ROOT / "data" / "fixtures", tmp_path / "data" / "fixtures")
    H = config["rollout"]["H"]
    strata = [f"{s['env']}-{s['label']}" for s in config["datasets"]["strata"]]
    study = config["studies"]["study1"]
    lambdas = {
        a: 0.0 if a == study["control"] else 0.1 + 0.2 * i for i, a in enumerate(study["actions"])
    }
    for m, model in enumerate(config["models"]):
        pairs = {s: stratum_pairs(100 * m + i, lambdas) for i, s in enumerate(strata)}
        files = write_synthetic_study(
            tmp_path,
            "study1",
            model,
            pairs,
            {"dev": (3, study["K_dev"]), "study1": (3, study["K"])},
            H,
            seed=config["seed"],
            control=study["control"],
            control_K=study["K_control"],
        )
        for action in study["actions"]:  # the engine's measured seconds (planning's costs)
            for i, path in enumerate(files[action].values()):
                frame = read_trajectories(path)
                paths = frame.select("doc_id", "replicate").unique().height
                timing = {
                    "documents": frame["doc_id"].n_unique(),
                    "paths": paths,
                    "prefill_seconds": 2.0 + i,
                    "selection_seconds": 0.5,
                    "decode_seconds": 0.01 * paths,
                }
                write_trajectories(
                    frame, path, {**read_trajectory_metadata(path), "timing": timing}
                )
    targets = [
        "results/study1/tables/estimands.csv",
        "results/study1/tables/prediction.csv",
        "results/study1/plan.json",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    snakemake = Path(sys.executable).parent / "snakemake"
    res = subprocess.run(
        [
            str(snakemake),
            *targets,
            "--snakefile",
            str(ROOT / "Snakefile"),
            "--directory",
            str(tmp_path),
            "--cores",
            "1",
            "--workflow-profile",
            "none",
            "--allowed-rules",
            *RULES,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    table = pl.read_csv(tmp_path / targets[0])
    assert set(table["model"]) == set(config["models"])
    assert {"pooled", *strata} == set(table["stratum"])
    control = table.filter(action=study["control"], estimand="R")
    assert (control["value"] == 0).all()
    assert (tmp_path / "results/study1/tables/estimands.md").read_text().startswith("| model")
    prediction = pl.read_csv(tmp_path / targets[1])
    assert set(prediction["observation"]) == {"positions_1_32", "fixed_history", "uncalibrated"}
    plan = json.loads((tmp_path / targets[2]).read_text())
    assert len(plan["plans"]) == len(config["models"]) * (len(study["actions"]) - 1)
    assert all(e["c_doc"] > 0 and e["c_rep"] == pytest.approx(0.01) for e in plan["plans"])
    for rule in RULES:
        assert any((tmp_path / "results" / "benchmarks" / rule).rglob("*.tsv")), rule
        assert any((tmp_path / "logs" / "analysis" / rule).rglob("*.log")), rule
