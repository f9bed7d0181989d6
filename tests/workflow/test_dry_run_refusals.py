"""Bad inputs through real ``snakemake`` runs: a dry run stops at parse time with one line and plans
no job; a failing job logs its traceback and points the console at it; names with ``+``, ``@`` and
``=`` are planned like any other, a bad name and a YTE-templated config file stop the dry run
(docs/configuration.md, "Security": Snakemake has evaluated the template by then, which the test
shows rather than hides)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from refusal_helpers import NAME_RULE, SCHEMA, one_line, tiny
from workflow_helpers import planned_jobs, run_snakemake, workflow_copy

from kvdiverge.config.reading import templated
from kvdiverge.datasets import DatasetsConfig
from kvdiverge.datasets.fitting import DatasetError
from kvdiverge.pipeline.folders import check_writable_folder

pytestmark = pytest.mark.slow


# ---- real Snakemake runs: a few cases end to end -----------------------------------------------
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return workflow_copy(tmp_path_factory.mktemp("bad-inputs"))


DRY_RUN_CASES = {
    "duplicate key in a config file": (
        "rollout:\n  H: 32\n  H: 16\n",
        "override.yaml line 3: duplicate key 'H' (first at line 2); a YAML mapping takes each "
        "key once",
    ),
    "integer written as float": (
        {"studies": {"study1": {"K_dev": 4.0}}},
        "config.studies.study1.K_dev: expected integer, got 4.0",
    ),
    "study whose cohort does not exist": (
        {"studies": {"study3": {"actions": ["snapkv-half", "full"]}}},
        "config.studies.study3 (its cohort is its name): no cohort 'study3' in "
        "config.datasets.cohorts (study1, study2); set config.studies.study3.cohort",
    ),
    "prediction pair with an unknown action": (
        {"analysis": {"prediction": {"pairs": {"study2": ["recent-90", "snapkv-512"]}}}},
        "config.analysis.prediction.pairs.study2: expected [b, a], two different non-control "
        "actions of the study (snapkv-90, recent-90), got ['recent-90', 'snapkv-512']",
    ),
    "H too small for the analysis clock": (
        {"rollout": {"H": 2}},
        "config.rollout.H: 2 is too short for the analysis clock: analysis.clock.window 0.125 "
        "(a fraction of H) makes 1 step, and window must lie in 1..branch_depth/2 = 0; "
        "expected rollout.H >= 4, or another analysis.clock.window",
    ),
    "cohort of size 0": (
        {"datasets": {"cohorts": {"study2": 0}}},
        "config.datasets.cohorts.study2: 0 documents per stratum, but study 'study2' evaluates "
        "on cohort 'study2'; expected an integer >= 1",
    ),
    "missing local model folder": (  # a third model: study 2's family grows to 12
        {
            "models": {"extra": {"path": "/nonexistent/models/extra"}},
            "studies": {"study2": {"family_endpoints": 12, "bootstrap_draws": 24000}},
        },
        "config.models.extra.path: /nonexistent/models/extra does not exist (expected a model "
        "folder holding config.json, or a hub id 'org/name')",
    ),
}


@pytest.mark.parametrize("case", list(DRY_RUN_CASES))
def test_dry_run_stops_before_any_job_with_one_line(case, work, tmp_path):
    override, expected = DRY_RUN_CASES[case]
    path = tmp_path / "override.yaml"
    path.write_text(override if isinstance(override, str) else yaml.safe_dump(override))
    res = run_snakemake(work, "-n", "--configfile", str(path))
    text = res.stdout + res.stderr
    assert res.returncode != 0, text[-2000:]
    assert planned_jobs(res) == {}  # stopped at parse time: no job planned
    lines = [line.strip() for line in text.splitlines()]
    wanted = str(path.parent / expected) if expected.startswith("override.yaml") else expected
    assert wanted in lines, text[-2000:]
    assert "Repo id must be in the form" not in text


def test_failing_dataset_job_logs_its_traceback_and_points_the_console_at_it(work, tmp_path):
    """The dataset and analysis scripts used to leave their log empty (kvdiverge.pipeline.logs)."""
    path = tmp_path / "override.yaml"
    path.write_text(yaml.safe_dump({"datasets": {"helmet": {"data_dir": "nowhere"}}}))
    target = "results/documents/helmet-1024.parquet"
    res = run_snakemake(work, target, "--configfile", str(path), timeout=300)
    text = res.stdout + res.stderr
    assert res.returncode != 0
    log = work / "results" / "logs" / "datasets" / "materialize_documents" / "helmet-1024.log"
    lines = [line for line in text.splitlines() if line.startswith("materialize_documents: ")]
    assert len(lines) == 1 and "HELMET file not found: nowhere/kilt/" in lines[0], text[-3000:]
    assert lines[0].endswith(f"(traceback in {log.relative_to(work)})")
    logged = log.read_text()
    assert "Traceback (most recent call last)" in logged and "HELMET file not found" in logged
    assert not (work / target).exists()


def test_dry_run_of_the_intact_copy_plans_every_job(work):
    res = run_snakemake(work, "-n")
    assert res.returncode == 0, res.stderr[-2000:]
    assert planned_jobs(res)["rollout_study1"] == 12


# ---- names: real dry runs ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def named_work(tmp_path_factory):
    """A copy of the workflow with a second copy of the demo model in a folder named x+lora."""
    work = workflow_copy(tmp_path_factory.mktemp("bad-names"))
    shutil.copytree(work / "data" / "models" / "tiny-llama", work / "data" / "models" / "x+lora")
    return work


def test_a_model_named_x_plus_lora_is_planned_like_any_other(named_work, tmp_path):
    """The raw `"|".join(names)` constraint made `x+lora` match no wildcard: never rolled out.
    A study and a later rollout group named with the same characters get their rules too."""
    override = {
        "models": {"x+lora": {"path": "data/models/x+lora"}},
        "studies": {
            "study2": {"family_endpoints": 12, "bootstrap_draws": 24000},  # three models
            "s+x@1": {
                "actions": ["snapkv-half", "recent-half", "full"],
                "cohort": "study1",
                "groups": {"main": ["snapkv-half", "full"], "mine+v2": ["recent-half"]},
            },
        },
    }
    path = tmp_path / "override.yaml"
    path.write_text(yaml.safe_dump(override))
    res = run_snakemake(named_work, "-n", "--configfile", str(path))
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-3000:]
    jobs = planned_jobs(res)
    assert jobs["dev_rollout_study1"] == jobs["rollout_study1"] == 18  # 3 models x 6 strata
    assert jobs["dev_rollout_s+x@1"] == jobs["rollout_s+x@1"] == 18
    assert jobs["rollout_s+x@1_mine+v2"] == 18 and jobs["prespecify_group"] == 1  # a later group
    assert "results/s+x@1/locks/mine+v2.json" in text
    for stratum in ("helmet-1024", "ruler-2048"):
        assert f"results/study1/x+lora/trajectories/snapkv-half/{stratum}.parquet" in text
        assert f"results/s+x@1/x+lora/dev/trajectories/full/{stratum}.parquet" in text
    assert "results/study1/x+lora/document_stats.parquet" in text


def test_a_bad_name_stops_the_dry_run_with_its_line(named_work, tmp_path):
    path = tmp_path / "override.yaml"
    path.write_text(yaml.safe_dump({"actions": {"../../x": {"selector": "full"}}}))
    res = run_snakemake(named_work, "-n", "--configfile", str(path))
    text = res.stdout + res.stderr
    assert res.returncode != 0
    assert planned_jobs(res) == {}
    assert f"config.actions.../../x: {NAME_RULE}, got '../../x'" in [
        s.strip() for s in text.splitlines()
    ]
    assert not (named_work / "results").exists() and not (named_work.parent / "x").exists()


def test_a_templated_config_file_is_refused_before_any_job(named_work, tmp_path):
    """Snakemake evaluates a YTE template while it loads the file, before the Snakefile runs:
    the marker shows that the expression ran (docs/configuration.md, "Security"); the project
    then refuses the run with one line, and no job is planned or run."""
    marker = tmp_path / "evaluated.txt"
    path = tmp_path / "templated.yaml"
    path.write_text(
        f"__use_yte__: true\nrollout:\n  H: ?open({str(marker)!r}, 'w').write('ran') and 32\n"
    )
    assert templated(path)
    res = run_snakemake(named_work, "-n", "--configfile", str(path))
    text = res.stdout + res.stderr
    assert res.returncode != 0
    assert planned_jobs(res) == {}
    line = (
        f"{path}: __use_yte__: YTE templating is refused; a config file holds values, not code "
        "(Snakemake has already evaluated its expressions while loading it; "
        'docs/configuration.md, "Security")'
    )
    assert line in [s.strip() for s in text.splitlines()], text[-3000:]
    assert marker.read_text() == "ran"  # evaluated by Snakemake before the workflow could refuse
    assert not (named_work / "results").exists()


# ---- a prompts file with no records, an output folder that cannot be written ----------------
def _custom_config(path: Path) -> dict:
    cfg = tiny()
    cfg["datasets"]["strata"].append(
        {"env": "custom", "label": "own", "target_tokens": 1024, "path": str(path)}
    )
    return cfg


def test_an_empty_custom_prompts_file_stops_the_parse(tmp_path):
    empty = tmp_path / "own.jsonl"
    empty.write_text("\n\n")
    cfg = _custom_config(empty)
    n = len(cfg["datasets"]["strata"]) - 1
    expected = (
        f"config.datasets.strata[{n}].path: {empty} holds no records (expected one JSON object "
        "per line, or one Parquet row, per prompt)"
    )
    from kvdiverge.config import check_config

    check_config(cfg, SCHEMA)
    with pytest.raises(DatasetError) as info:
        DatasetsConfig.from_config(cfg["datasets"])
    assert one_line(info) == expected
    few = tmp_path / "few.jsonl"
    few.write_text(json.dumps({"prompt": "p", "answers": ["a"]}) + "\n")
    with pytest.raises(DatasetError) as info:
        DatasetsConfig.from_config(_custom_config(few)["datasets"])
    assert one_line(info).startswith(
        f"config.datasets.strata[{n}].path: stratum custom-own: the plan needs "
    )
    work = workflow_copy(tmp_path)
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    res = run_snakemake(work, "-n")
    assert res.returncode != 0 and expected in (res.stdout + res.stderr).splitlines()
    assert planned_jobs(res) == {}  # the dry run plans nothing
    assert not (work / "results").exists()


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder this process cannot write: mode 0555, and for root (whom modes do not stop)
    the immutable attribute."""
    folder = tmp_path / "archived"
    folder.mkdir()
    (folder / "kept.txt").write_text("an earlier result\n")
    immutable = os.geteuid() == 0
    if immutable:
        done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"root cannot make a folder read-only here: {done.stderr.strip()}")
    else:
        folder.chmod(0o555)
    yield folder
    if immutable:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    folder.chmod(0o755)


def test_a_read_only_output_folder_stops_the_run_before_its_first_job(read_only_folder, tmp_path):
    target = read_only_folder / "results"
    with pytest.raises(ValueError) as info:
        check_writable_folder(target, "config.output_dir")
    reason = "Operation not permitted" if os.geteuid() == 0 else "Permission denied"
    expected = (
        f"config.output_dir: {target} (its nearest existing parent {read_only_folder}) is not "
        f"writable ({reason}); make it writable or choose another output_dir"
    )
    assert one_line(info) == expected
    work = workflow_copy(tmp_path)
    cfg = tiny()
    cfg["output_dir"] = str(target)
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert run_snakemake(work, "-n").returncode == 0  # a dry run writes nothing there
    res = run_snakemake(work)
    text = res.stdout + res.stderr
    assert res.returncode != 0 and expected in text.splitlines()
    assert "Traceback" not in text
    assert [p.name for p in read_only_folder.iterdir()] == ["kept.txt"]  # nothing written
