"""The analysis rules run by Snakemake on placed synthetic trajectories (no rollouts): the plan
and the lock from the development files, then — the evaluation files carrying the lock's hash,
as the rollout job writes them — document statistics, estimands and prediction; and the
estimands step stopping when an endpoint changes after the evaluation (docs/prespecification.md,
"Fixed by the lock")."""

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
from registration_helpers import file_meta
from workflow_helpers import planned_jobs

from kvdiverge.analysis.prespecification import read_lock
from kvdiverge.analysis.synthetic import stratum_pairs, write_synthetic_study
from kvdiverge.config import validate_config
from kvdiverge.io.model_digest import model_digests
from kvdiverge.io.trajectories import (
    read_trajectories,
    read_trajectory_metadata,
    write_trajectories,
)

ROOT = Path(__file__).resolve().parents[2]
RULES = ["plan_sample_sizes", "prespecify", "document_stats", "estimands", "prediction"]
TARGETS = [
    "results/study1/tables/estimands.csv",
    "results/study1/tables/prediction.csv",
    "results/study1/plan.json",
    "results/study2/tables/estimands.csv",
]


def _snakemake(
    work: Path, *args: str, pythonpath: Path | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if pythonpath is not None:  # import (and fingerprint) a copy of the package
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(pythonpath), env.get("PYTHONPATH")) if p
        )
    snakemake = Path(sys.executable).parent / "snakemake"
    return subprocess.run(
        [
            str(snakemake),
            *args,
            "--snakefile",
            str(ROOT / "Snakefile"),
            "--directory",
            str(work),
            "--cores",
            "1",
            "--workflow-profile",
            "none",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def _rolled_out(meta: dict, folder: Path) -> dict:
    """A synthetic file's metadata with what a rollout job records of its numerics: the model
    by name, its folder's digests, the device, dtype, kernels and libraries."""
    name = meta["model"]
    return {
        **meta,
        "model": {"name": name, "path": f"data/models/{name}"},
        "model_digest": model_digests(folder / name),
        "device": "cpu",
        "dtype": "float64",
        "kernel": {},
        "libraries": {"torch": "synthetic", "transformers": "synthetic", "kvpress": "synthetic"},
    }


def _split(path: Path, dev_path: Path, cohort: str, models: Path) -> None:
    """Move a synthetic file's development documents to their own file (the development
    rollout's) and keep the study's evaluation cohort in it, each with the engine's measured
    seconds and the numerics a rollout records (``models``: the work folder's model folders)."""
    frame, meta = read_trajectories(path), read_trajectory_metadata(path)
    meta = _rolled_out(meta, models)
    parts = {c: frame.filter(pl.col("doc_id").str.contains(f"/{c}/")) for c in ("dev", cohort)}
    for part, target in ((parts["dev"], dev_path), (parts[cohort], path)):
        paths = part.select("doc_id", "replicate").unique().height
        docs = part["doc_id"].n_unique()
        timing = {
            "documents": docs,
            "paths": paths,
            "prefill_seconds": 2.0 * docs,
            "selection_seconds": 0.5 * docs,
            "decode_seconds": 0.01 * paths,
        }
        target.parent.mkdir(parents=True, exist_ok=True)
        write_trajectories(part, target, {**meta, "timing": timing, "n_documents": docs})


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    """configs/tiny.yaml's two studies on synthetic trajectories: the plans and locks first,
    then the analysis of evaluation files rolled out under those locks."""
    work = tmp_path_factory.mktemp("analysis")
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    validate_config(config, ROOT / "workflow" / "schemas" / "config.schema.yaml")
    shutil.copy(ROOT / "configs" / "tiny.yaml", work / "config.yaml")
    shutil.copytree(ROOT / "data" / "fixtures", work / "data" / "fixtures")
    for model in config["models"]:  # the committed demo models stand in for their rule
        shutil.copytree(ROOT / "data" / "models" / model, work / "data" / "models" / model)
    H = config["rollout"]["H"]
    max_K = config["analysis"]["planning"]["max_K"]  # the lock's K is at most this
    strata = [f"{s['env']}-{s['label']}" for s in config["datasets"]["strata"]]
    evaluation = []
    for name, study in config["studies"].items():
        lambdas = {
            a: 0.0 if a == study["control"] else 0.1 + 0.2 * i
            for i, a in enumerate(study["actions"])
        }
        for m, model in enumerate(config["models"]):
            pairs = {s: stratum_pairs(100 * m + i, lambdas) for i, s in enumerate(strata)}
            files = write_synthetic_study(
                work,
                name,
                model,
                pairs,
                {"dev": (3, study["K_dev"]), **{c: (3, max_K) for c in config["studies"]}},
                H,
                seed=config["seed"],
                control=study["control"],
                control_K=study["K_control"],
            )
            for action in study["actions"]:  # the development stage's files
                for stratum, path in files[action].items():
                    dev = (
                        work / f"results/{name}/{model}/dev/trajectories/{action}/{stratum}.parquet"
                    )
                    _split(path, dev, name, work / "data" / "models")
                    staged = path.with_suffix(".staged")  # rolled out only after the lock
                    path.rename(staged)
                    evaluation.append((name, model, action, path, staged))
    for dev in (work / "results").glob("*/*/dev/trajectories/*/*.parquet"):
        os.utime(dev)  # newer than every documents table (rewritten once per study and model)
    locks = [f"results/{name}/lock.json" for name in config["studies"]]
    res = _snakemake(work, *locks, "--allowed-rules", *RULES)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    locks = {name: read_lock(work / f"results/{name}/lock.json") for name in config["studies"]}
    for name, model, action, path, staged in evaluation:  # the evaluation files, under the lock
        frame, meta = read_trajectories(staged), read_trajectory_metadata(staged)
        meta = {**meta, **file_meta(locks[name], action, model)}
        (K,) = meta["K"].values()  # the lock's K (K_control for the control)
        write_trajectories(frame.filter(pl.col("replicate") < K), path, meta)
        staged.unlink()
    res = _snakemake(work, *TARGETS, "--allowed-rules", *RULES)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return work, config, strata


@pytest.mark.slow
def test_analysis_rules_on_synthetic_trajectories(analysed):
    work, config, strata = analysed
    study = config["studies"]["study1"]
    table = pl.read_csv(work / TARGETS[0])
    assert set(table["model"]) == set(config["models"])
    assert {"pooled", *strata} == set(table["stratum"])
    control = table.filter(action=study["control"], estimand="R")
    assert (control["value"] == 0).all()
    markdown = (work / "results/study1/tables/estimands.md").read_text()
    assert markdown.startswith("Registration 1 of study1 (lock ")  # the lock's registration
    assert "no earlier registration; first registration)." in markdown.splitlines()[0]
    assert markdown.splitlines()[2].startswith("Intervals: percentile bootstrap over documents")
    assert markdown.splitlines()[4].startswith("| model")
    prediction = pl.read_csv(work / TARGETS[1])
    assert set(prediction["observation"]) == {"positions_1_32", "fixed_history", "uncalibrated"}
    plan = json.loads((work / TARGETS[2]).read_text())
    assert len(plan["plans"]) == len(config["models"]) * (len(study["actions"]) - 1)
    # the cost model counts tokens (the synthetic prompts' 100), not the files' seconds (2.5 s
    # per document, 0.01 s per path), which the plan keeps for information
    assert all(e["c_doc"] == 100 for e in plan["plans"])
    assert all(e["c_rep"] >= 2 * config["rollout"]["H"] for e in plan["plans"])
    seconds = [m["seconds"] for m in plan["measured"]["pairs"]]
    assert all(m == pytest.approx({"c_doc": 2.5, "c_rep": 0.01}) for m in seconds)
    assert all(e["K_dev"] == study["K_dev"] for e in plan["plans"])
    for rule in RULES[:-1] + ["prediction"]:
        assert any((work / "results" / "benchmarks" / rule).rglob("*.tsv")), rule
        assert any((work / "results" / "logs" / "analysis" / rule).rglob("*.log")), rule


def _placed(work: Path, models: list[str]) -> tuple[dict, list[str]]:
    """configs/tiny.yaml's two studies as synthetic development and evaluation files of
    ``models`` (no lock: rule document_stats reads none)."""
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    validate_config(config, ROOT / "workflow" / "schemas" / "config.schema.yaml")
    shutil.copy(ROOT / "configs" / "tiny.yaml", work / "config.yaml")
    shutil.copytree(ROOT / "data" / "fixtures", work / "data" / "fixtures")
    for model in config["models"]:
        shutil.copytree(ROOT / "data" / "models" / model, work / "data" / "models" / model)
    H = config["rollout"]["H"]
    strata = [f"{s['env']}-{s['label']}" for s in config["datasets"]["strata"]]
    for name, study in config["studies"].items():
        lambdas = {
            a: 0.0 if a == study["control"] else 0.1 + 0.2 * i
            for i, a in enumerate(study["actions"])
        }
        for m, model in enumerate(models):
            pairs = {s: stratum_pairs(100 * m + i, lambdas) for i, s in enumerate(strata)}
            cohorts = {"dev": (3, study["K_dev"]), **{c: (3, 2) for c in config["studies"]}}
            files = write_synthetic_study(
                work, name, model, pairs, cohorts, H, seed=config["seed"],
                control=study["control"], control_K=study["K_control"],
            )  # fmt: skip
            for action in study["actions"]:
                for stratum, path in files[action].items():
                    folder = work / f"results/{name}/{model}/dev/trajectories/{action}"
                    _split(path, folder / f"{stratum}.parquet", name, work / "data" / "models")
    for dev in (work / "results").glob("*/*/dev/trajectories/*/*.parquet"):
        os.utime(dev)  # newer than every documents table
    return config, strata


@pytest.mark.slow
@pytest.mark.parametrize("recorded", [True, False])
def test_a_trajectory_file_copied_from_another_study_stops_in_one_line(tmp_path, recorded):
    """Study 1's evaluation file of the control copied over study 2's: rule document_stats
    stops in one line, by the study the file records (as rollout jobs write it) or, for a file
    that records none, by the cohort of its documents."""
    model = "tiny-llama"
    config, strata = _placed(tmp_path, [model])
    stratum, control = strata[0], config["studies"]["study2"]["control"]
    assert control == config["studies"]["study1"]["control"]
    source = tmp_path / f"results/study1/{model}/trajectories/{control}/{stratum}.parquet"
    shown = f"results/study2/{model}/trajectories/{control}/{stratum}.parquet"
    frame, meta = read_trajectories(source), read_trajectory_metadata(source)
    write_trajectories(frame, tmp_path / shown, {**meta, "study": "study1"} if recorded else meta)
    target = f"results/study2/{model}/document_stats.parquet"
    res = _snakemake(tmp_path, target, "--allowed-rules", "document_stats")
    text = res.stdout + res.stderr
    assert res.returncode != 0 and not (tmp_path / target).exists()
    lines = [line for line in text.splitlines() if line.startswith("document_stats: ")]
    assert len(lines) == 1, text[-3000:]
    if recorded:
        expected = (
            f"document_stats: AnalysisInputError: {shown}: its metadata says study 'study1', but "
            "it is read as the trajectory file of study 'study2'; expected the file written for "
            "study 'study2' (files swapped or copied under another name: rerun that job)"
        )
    else:
        expected = (
            f"document_stats: AnalysisInputError: {shown}: holds documents of cohort 'study1', "
            "but it is read as the trajectory file of cohort study2; expected only its documents "
            "(files swapped or copied under another name: rerun that job)"
        )
    assert lines[0].startswith(expected), lines[0]


@pytest.mark.slow
def test_an_endpoint_changed_after_the_evaluation_stops_the_estimands(analysed, tmp_path):
    """Study 2's family changed after the evaluation rollouts, and only the analysis rerun: the
    estimands step refuses in one line naming the change. The deliberate way, a full run,
    re-plans (the plan sizes the endpoints), re-locks and reruns the evaluation stage
    (rollouts, statistics, estimands) and no development rollout."""
    work, config, _ = analysed
    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump({"analysis": {"family_estimands": ["S_99"]}}))
    target = "results/study2/tables/estimands.csv"
    changed = ("--configfile", str(path))  # merged into the copy's config.yaml
    res = _snakemake(work, target, "--allowed-rules", "estimands", *changed)
    text = res.stdout + res.stderr
    assert res.returncode != 0
    lines = [line for line in text.splitlines() if line.startswith("estimands: ")]
    assert len(lines) == 1, text[-3000:]
    assert lines[0].startswith(
        "estimands: PrespecificationError: results/study2/lock.json: the config no longer "
        'matches the lock (endpoints.estimands: locked ["S_99", "branch_contrast_B"], now '
        '["S_99"]); rerun the workflow to re-lock'
    ), lines[0]
    # the study's own stages (documents and models are placed here, their rules left out)
    stages = ["dev_rollout_study2", "plan_sample_sizes", "prespecify", "rollout_study2"]
    stages += ["document_stats", "estimands"]
    dry = _snakemake(work, "-n", target, "--allowed-rules", *stages, *changed)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert planned_jobs(dry) == {
        "plan_sample_sizes": 1,
        "prespecify": 1,
        "rollout_study2": len(config["models"]) * len(config["datasets"]["strata"]),
        "document_stats": len(config["models"]),
        "estimands": 1,
    }


@pytest.mark.slow
def test_an_edit_to_the_endpoint_code_after_locking_stops_the_estimands(analysed, tmp_path):
    """The lock registers the fingerprint of the code computing study 2's endpoints: a code edit
    in a module the estimands script imports (here in a copy of the package) reruns the
    estimands step, which stops in one line naming the lock, and writes nothing."""
    work, _, _ = analysed
    pkg = tmp_path / "pkg"
    shutil.copytree(
        ROOT / "src" / "kvdiverge", pkg / "kvdiverge", ignore=shutil.ignore_patterns("__pycache__")
    )
    target = "results/study2/tables/estimands.csv"
    same = _snakemake(work, target, "--allowed-rules", "estimands", pythonpath=pkg)
    assert same.returncode == 0 and (work / target).exists(), same.stderr[-3000:]  # the same code
    bootstrap = pkg / "kvdiverge" / "analysis" / "bootstrap.py"
    bootstrap.write_text(bootstrap.read_text() + "\n_EDITED_AFTER_LOCKING = 1\n")
    res = _snakemake(work, target, "--allowed-rules", "estimands", pythonpath=pkg)
    text = res.stdout + res.stderr
    assert res.returncode != 0
    lines = [line for line in text.splitlines() if line.startswith("estimands: ")]
    assert len(lines) == 1, text[-3000:]
    registered = read_lock(work / "results/study2/lock.json")["endpoints"]["code"]
    assert lines[0].startswith(
        "estimands: PrespecificationError: results/study2/lock.json: the code that computes the "
        "locked endpoints changed after registration (fingerprint "
    ), lines[0]
    assert f", registered {registered}); restore it, or register anew: delete " in lines[0]
    assert not (work / target).exists()
