"""The paper configuration, the SLURM profile and the output folder per config, resolved by dry
runs (issues 6 and 17).

configs/paper.yaml differs from config.yaml only in values; its models are replaced here by
stand-in local folders (nothing is downloaded: a dry run loads no model; the folders pass the
parse-time model checks, tests/workflow_helpers.py).
"""

from __future__ import annotations

import re

import pytest
import yaml
from workflow_helpers import (
    ROOT,
    planned_jobs,
    run_snakemake,
    workflow_copy,
    write_stand_in_model,
)

PAPER = yaml.safe_load((ROOT / "configs" / "paper.yaml").read_text())


def _stand_in_models(tmp_path):
    models = {}
    for name, spec in PAPER["models"].items():
        folder = write_stand_in_model(tmp_path / "stand-in" / name)
        models[name] = {**spec, "path": str(folder)}
    override = tmp_path / "stand-in.yaml"
    override.write_text(yaml.safe_dump({"models": models}))
    return override


def _expected_jobs() -> dict[str, int]:
    """Jobs of a full paper run, from the study design: 6 strata, 2 models, 2 studies."""
    strata, models, studies = 6, 2, ["study1", "study2"]
    assert len(PAPER["datasets"]["strata"]) == strata and len(PAPER["models"]) == models
    return {
        "materialize_documents": strata,
        **{f"dev_rollout_{study}": models * strata for study in studies},
        **{f"rollout_{study}": models * strata for study in studies},
        "document_stats": len(studies) * models,
        "estimands": len(studies),
        "prediction": 1,
        "plan_sample_sizes": len(studies),
        "prespecify": len(studies),
        "study_figures": len(studies),
        "study_branch_figure": 1,
        "study_tables": len(studies),
        # each study names a baseline: its contrasts and summary sentences
        "study_contrasts": sum(1 for s in studies if PAPER["studies"][s].get("baseline")),
        "accuracy": len(studies),
        "study_generations": len(studies),  # each study's generations page of the report
        "study_metrics": len(studies),  # each study's metrics.json and landing section
        "study_cache_bytes": len(studies),  # each study's cache bytes beside its budgets
        "introductory_figure": 1,
        "finite_state_systems": 1,
        "finite_state_figures": 1,
        "all": 1,
    }


def _planned_paths(text: str) -> list[str]:
    """Every output, log and benchmark path of the jobs a dry run lists."""
    lines = re.findall(r"^\s+(?:output|log|benchmark): (.*)$", text, re.M)
    return [path for line in lines for path in line.split(", ")]


def _outside(paths: list[str], folder: str) -> list[str]:
    """The paths neither under ``folder`` nor under data/models/ (models are shared)."""
    return [p for p in paths if not p.startswith((f"{folder}/", "data/models/"))]


def _paper_dry_run(tmp_path, *options: str):
    """``snakemake -n`` of configs/paper.yaml (stand-in model paths) with extra ``options``."""
    work = workflow_copy(tmp_path)
    override = _stand_in_models(tmp_path)
    return run_snakemake(
        work,
        "-n",
        *options,
        "--replace-workflow-config",
        "--configfile",
        "configs/paper.yaml",
        str(override),
    )


@pytest.mark.slow
def test_paper_config_dry_run_lists_every_job(tmp_path):
    res = _paper_dry_run(tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert planned_jobs(res) == _expected_jobs()
    paths = _planned_paths(res.stdout + res.stderr)
    assert PAPER["output_dir"] == "results/paper"
    assert "results/paper/study1/tables/estimands.csv" in paths
    assert _outside(paths, "results/paper") == []


@pytest.mark.slow
def test_slurm_profile_dry_run_resolves_gpu_resources(tmp_path):
    """Every rollout job asks for what `rollout.resources` of the paper config says, from its
    rule: the profile names no rule (a new study needs no edit there) and holds site settings
    only; the other jobs keep the profile's defaults, in its default partition, with no GPU."""
    profile = yaml.safe_load((ROOT / "profiles/slurm/config.v8+.yaml").read_text())
    assert "set-resources" not in profile and "set-threads" not in profile
    assert set(profile["default-resources"]) <= {
        "slurm_account",
        "slurm_partition",
        "mem_mb",
        "runtime",
    }
    res = _paper_dry_run(tmp_path, "--workflow-profile", "profiles/slurm")
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-3000:]
    assert planned_jobs(res) == _expected_jobs()
    blocks = re.split(r"\n(?=rule |localrule )", text)
    rollouts = [b for b in blocks if b.startswith(("rule rollout_", "rule dev_rollout_"))]
    expected = _expected_jobs()
    assert len(rollouts) == sum(v for k, v in expected.items() if "rollout_" in k)
    wanted = PAPER["rollout"]["resources"]
    assert "gpu_model" not in wanted and "partition" not in wanted  # site settings
    (entry,) = profile["config"]
    site = yaml.safe_load(entry.split("=", 1)[1])["resources"]
    for block in rollouts:
        resources = re.search(r"resources: (.*)", block).group(1)
        assert f"runtime={wanted['runtime']}" in resources, resources
        assert f"mem_mb={wanted['mem_mb']}" in resources, resources
        # the partition is the site's, from the profile's `config:` entry; no GPU model is
        # asked for (a site setting: profile or command line, not the shared config)
        assert f"slurm_partition={site['partition']}" in resources, resources
        assert f"gpu={wanted['gpus']}" in resources, resources
        assert "gpu_model" not in resources, resources
        assert f"cpus_per_gpu={wanted['cpus_per_gpu']}" in resources, resources
    assert wanted["gpus"] >= 1
    defaults = profile["default-resources"]
    for rule in ("materialize_documents", "plan_sample_sizes"):
        block = next(b for b in blocks if b.startswith(f"rule {rule}:"))
        resources = re.search(r"resources: (.*)", block).group(1)
        assert f"slurm_partition={defaults['slurm_partition']}" in resources, resources
        assert f"mem_mb={defaults['mem_mb']}" in resources and "gpu" not in resources, resources
    others = [b for b in blocks if b.startswith("rule document_stats")]
    assert others and all("gpu=" not in b and "mem_mb=32000" in b for b in others)


@pytest.mark.slow
def test_output_dir_holds_every_result_and_benchmark(tmp_path):
    """Another `output_dir` moves every job's outputs, documents, logs and benchmark records,
    and the targets of `rule all`, under it: nothing is planned under results/ or logs/."""
    work = workflow_copy(tmp_path)
    res = run_snakemake(work, "-n", "--config", "output_dir=runs/other")
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-3000:]
    default = run_snakemake(work, "-n")
    assert planned_jobs(res) == planned_jobs(default) != {}
    paths = _planned_paths(text)
    assert len(paths) == len(_planned_paths(default.stdout + default.stderr))
    assert "runs/other/benchmarks/estimands/study1.tsv" in paths
    assert "runs/other/study2/figures/fig5_divergence_cdf.png" in paths
    assert "runs/other/documents/ruler-1024.parquet" in paths
    assert "runs/other/logs/analysis/estimands/study1.log" in paths
    assert _outside(paths, "runs/other") == []
    # rule all prints one line (its message); its targets are outputs of the jobs checked above
    assert re.search(r"rule all: the [1-9]\d* final outputs under runs/other/$", text, re.M), text
