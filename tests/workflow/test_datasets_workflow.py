"""End to end: rule materialize_documents on the embedded default."""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl
import pytest
import yaml
from workflow_helpers import run_snakemake, workflow_copy

from kvdiverge.datasets import DatasetsConfig, read_documents

ROOT = Path(__file__).resolve().parents[2]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")


def _default_strata() -> list[str]:
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    return [f"{s['env']}-{s['label']}" for s in config["datasets"]["strata"]]


@pytest.mark.slow
def test_every_default_stratum_is_a_job(tmp_path):
    work = workflow_copy(tmp_path)
    targets = [f"results/documents/{s}.parquet" for s in _default_strata()]
    assert len(targets) == 6
    run = run_snakemake(work, "-n", *targets)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "materialize_documents" in run.stdout + run.stderr
    bad = run_snakemake(work, "-n", "results/documents/ruler-999.parquet")
    assert bad.returncode != 0  # only configured strata match the wildcard


@pytest.mark.slow
def test_rule_materializes_a_stratum(tmp_path):
    work = workflow_copy(tmp_path)
    stratum = "ruler-1536"
    run = run_snakemake(work, f"results/documents/{stratum}.parquet")
    assert run.returncode == 0, run.stderr[-3000:]
    frame = read_documents(work / "results" / "documents" / f"{stratum}.parquet")
    config = yaml.safe_load((work / "config.yaml").read_text())
    cfg = DatasetsConfig.from_config(config["datasets"])
    assert frame.height == sum(cfg.cohorts.values())
    assert frame["n_tokens"].max() <= 1536 - cfg.generation_reserve
    assert {"vt", "cwe", "fwe", "qa_1", "qa_2"} <= set(frame["task"])
    assert (frame["stratum"] == stratum).all()
    assert frame.filter(pl.col("task") == "qa_1")["source"][0].endswith("(synthetic)")
    log = work / "results" / "logs" / "datasets" / "materialize_documents" / f"{stratum}.log"
    assert f"{stratum}: {frame.height} documents" in log.read_text()
    bench = work / "results" / "benchmarks" / "materialize_documents" / f"{stratum}.tsv"
    assert bench.is_file()
    # a missing HELMET file fails the job with the one line that names the archive
    config["datasets"]["helmet"]["data_dir"] = "nowhere"
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    run = run_snakemake(work, "results/documents/helmet-1024.parquet")
    assert run.returncode != 0
    assert "HELMET file not found: nowhere/kilt/" in run.stderr + run.stdout
