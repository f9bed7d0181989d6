"""End to end: rules build_demo_model, dev_rollout_<study> and rollout_<study>, with the plan
and the lock between them (docs/prespecification.md, "Order of the stages")."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import polars as pl
import pytest
import yaml
from workflow_helpers import (
    ROOT,
    fixture_stratum_config,
    package_env,
    place_fixture_documents,
    planned_jobs,
    run_snakemake,
    workflow_copy,
)

from kvdiverge.analysis.prespecification import read_lock
from kvdiverge.io.locks import evaluation_seed
from kvdiverge.io.trajectories import read_trajectories, read_trajectory_metadata

FIXTURE = ROOT / "tests" / "data" / "documents" / "ruler-1024.parquet"
# study 1 without snapkv-512 here: its contrasts and prediction pair follow; study 1 takes K
# from its plan, study 2 pins it
SMALL = fixture_stratum_config(
    H=10,
    max_K=3,
    studies={
        "study1": {"actions": ["snapkv-half", "recent-half", "full"], "K": "plan", "K_dev": 2},
        "study2": {"actions": ["recent-90", "full"], "K": 2, "K_dev": 2, "K_control": 1},
    },
)


def _workdir(tmp_path: Path, package: bool = False) -> Path:
    """A copy of the workflow (tests/workflow_helpers.py) with the fixture stratum's documents
    (and its own copy of the package with ``package``)."""
    work = workflow_copy(tmp_path, package=package)
    place_fixture_documents(work)
    return work


def _snakemake(work: Path, *args: str) -> subprocess.CompletedProcess:
    env = package_env(work) if (work / "pkg").is_dir() else None
    return run_snakemake(work, *args, env=env, timeout=600)


@pytest.mark.slow
def test_rollout_rules_write_every_action_of_a_study_in_one_job(tmp_path):
    """Each study's development jobs, then its plan and lock, then its evaluation jobs: one job
    per (study, model, stratum) and stage writes every action's file; the evaluation files carry
    the lock's K (the plan's for study 1, the pinned one for study 2) and its hash."""
    work = _workdir(tmp_path, package=True)
    override = tmp_path / "small.yaml"
    override.write_text(yaml.safe_dump(SMALL))
    jobs = {("study1", "tiny-llama"), ("study2", "tiny-qwen")}
    paths = {
        (study, model, action): f"results/{study}/{model}/trajectories/{action}/ruler-1024.parquet"
        for study, model in jobs
        for action in SMALL["studies"][study]["actions"]
    }
    # The fixture stands in for materialize_documents' output (another stage's rule).
    rules = [
        "build_demo_model",
        "dev_rollout_study1",
        "dev_rollout_study2",
        "plan_sample_sizes",
        "prespecify",
        "rollout_study1",
        "rollout_study2",
    ]
    run = ["--allowed-rules", *rules, "--configfile", str(override)]
    res = _snakemake(work, *paths.values(), *run)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (work / "data/models/tiny-llama/model.safetensors").exists()
    assert (work / "data/models/tiny-qwen/tokenizer.json").exists()
    # one job per (study, model, stratum): one log and one benchmark each
    for study, model in jobs:
        log = work / f"results/logs/rollout/{study}/{model}/ruler-1024.log"
        text = log.read_text()  # progress by document and decode step, plain lines
        assert "\r" not in text and "documents: " in text and "decode steps: " in text
        assert (work / f"results/benchmarks/rollout/{study}/{model}/ruler-1024.tsv").exists()
    assert len(list((work / "results" / "logs" / "rollout").rglob("*.log"))) == len(jobs)
    # each study's plan needs the development files of every model
    assert len(list((work / "results" / "logs" / "dev_rollout").rglob("*.log"))) == 4
    locks = {study: read_lock(work / f"results/{study}/lock.json") for study in SMALL["studies"]}
    plan1 = json.loads((work / "results/study1/plan.json").read_text())
    assert plan1["K_source"] == "plan" and 1 <= plan1["K"] <= 3
    assert locks["study1"]["design"]["K"] == plan1["K"] and locks["study2"]["design"]["K"] == 2

    frames = {t: read_trajectories(work / p) for t, p in paths.items()}
    docs = pl.read_parquet(FIXTURE)
    for (study, model, action), frame in frames.items():
        meta = read_trajectory_metadata(work / paths[(study, model, action)])
        assert meta["action"]["name"] == action and meta["H"] == 10
        assert meta["coupling"] == "shared-reference" and meta["device"] == "cpu"
        assert meta["model"]["name"] == model and meta["dtype"] == "float32"
        assert meta["study"] == study  # its readers check it (kvdiverge.io.roles)
        spec = SMALL["studies"][study]
        control_K = spec.get("K_control", 2)
        K = control_K if action == "full" else locks[study]["design"]["K"]
        assert meta["K"] == {study: K} and meta["lock"] == locks[study]["hash"]
        per_doc = frame.group_by("doc_id").agg(pl.col("replicate").n_unique().alias("K"))
        wanted = docs.filter(pl.col("cohort") == study)
        assert sorted(per_doc["doc_id"]) == sorted(wanted["doc_id"])
        assert meta["n_documents"] == wanted.height and (per_doc["K"] == K).all()
        assert frame.height == per_doc["K"].sum() * 10
        dev_path = work / paths[(study, model, action)].replace(
            "/trajectories/", "/dev/trajectories/"
        )
        dev_meta = read_trajectory_metadata(dev_path)
        assert dev_meta["K"] == {"dev": control_K if action == "full" else spec["K_dev"]}
        assert "lock" not in dev_meta
        # the evaluation's seed is the registration's, the development keeps the config's
        assert meta["seed"] == evaluation_seed(locks[study]) != dev_meta["seed"]
        assert dev_meta["seed"] == yaml.safe_load((work / "config.yaml").read_text())["seed"]
        assert dev_path.stat().st_mtime <= (work / f"results/{study}/lock.json").stat().st_mtime
        assert (frame.filter(pl.col("t") == 1)["tv_rollout"] == 0).all()  # δ_1 = 0
        assert (frame["n_kept"] <= frame["n_prompt"]).all()
        if action == "full":  # its own rows over the gathered full cache: rounding only
            assert frame["tv_rollout"].max() < 1e-5 and frame["tv_fixed"].max() < 1e-5
            assert (frame["x_token"] == frame["y_token"]).all()
            assert (frame["n_kept"] == frame["n_prompt"]).all()

    snap = frames[("study1", "tiny-llama", "snapkv-half")]
    assert (snap["n_kept"] == snap["n_prompt"] // 2).all()
    assert snap["mismatch"].any()
    recent90 = frames[("study2", "tiny-qwen", "recent-90")]
    assert (recent90["n_kept"] == recent90["n_prompt"] * 9 // 10).all()
    # the same reference X for every action of a study, path by path (common random numbers)
    for study, model in jobs:
        actions = SMALL["studies"][study]["actions"]
        full = frames[(study, model, "full")]
        for action in actions:
            joined = full.join(frames[(study, model, action)], on=["doc_id", "replicate", "t"])
            assert joined.height == full.height
            assert (joined["x_token"] == joined["x_token_right"]).all()

    # A method's edit reruns only the rollouts of the studies whose actions use it: study 2 has
    # no SnapKV action (the rollout fingerprint names the job's selectors; docs/architecture.md,
    # "Reruns").
    assert planned_jobs(_snakemake(work, "-n", *paths.values(), *run)) == {}
    eviction = work / "pkg" / "kvdiverge" / "eviction" / "builtin.py"
    original = eviction.read_text()
    head = "class SnapKVSelector(ScoredSelector):\n"
    assert original.count(head) == 1
    eviction.write_text(original.replace(head, head + "    _AN_EDIT = 1\n"))
    try:
        planned = planned_jobs(_snakemake(work, "-n", *paths.values(), *run))
    finally:
        eviction.write_text(original)
    assert planned.get("dev_rollout_study1") and planned.get("rollout_study1"), planned
    assert "dev_rollout_study2" not in planned and "rollout_study2" not in planned, planned


@pytest.mark.slow
def test_invalid_action_is_one_line_before_any_work(tmp_path):
    work = _workdir(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump({"actions": {"snapkv-tiny": {"selector": "snapkv", "budget": 16}}})
    )
    res = _snakemake(work, "-n", "--configfile", str(bad))
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert "actions.snapkv-tiny.budget: 16 is below the observation window 64" in out
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(yaml.safe_dump({"studies": {"study1": {"actions": ["h2o-half"]}}}))
    res = _snakemake(work, "-n", "--configfile", str(unknown))
    assert res.returncode != 0
    assert "config.studies.study1.actions: 'h2o-half' is not in config.actions" in (
        res.stdout + res.stderr
    )


@pytest.mark.slow
def test_several_eos_ids_through_the_pipeline_are_one_outcome(tmp_path):
    """A model whose generation config lists several EOS ids: the rollout rule's files (and
    the per-document statistics) are identical whatever the order of the list, and the second
    id does end sequences."""
    import json

    import numpy as np

    from kvdiverge.analysis.document_stats import document_stats
    from kvdiverge.engine import RolloutSettings, paths_under_action
    from kvdiverge.models import chat_prompt_ids, load_model, load_tokenizer

    work = _workdir(tmp_path)
    demo = work / "data" / "models" / "tiny-llama"
    tokenizer, model = load_tokenizer(str(demo)), load_model(str(demo))
    prompt = pl.read_parquet(FIXTURE)["prompt"][0]
    probe = paths_under_action(
        model,
        chat_prompt_ids(tokenizer, prompt),
        {"name": "full", "selector": "full"},
        "probe",
        8,
        [tokenizer.eos_token_id],
        RolloutSettings(10, 1, identity_shortcut=True),
    )  # the frequent tokens of the full cache
    frequent = int(np.bincount(probe.x_token[:, 1:].ravel()).argmax())
    assert frequent != tokenizer.eos_token_id
    models = {}
    for name, order in (("eos-ab", [tokenizer.eos_token_id, frequent]), ("eos-ba", None)):
        order = order or models["eos-ab"][::-1]
        folder = work / "data" / "extra" / name
        shutil.copytree(demo, folder)
        generation = json.loads((folder / "generation_config.json").read_text())
        (folder / "generation_config.json").write_text(
            json.dumps({**generation, "eos_token_id": order})
        )
        models[name] = order
    override = tmp_path / "eos.yaml"
    override.write_text(
        yaml.safe_dump(
            {
                **SMALL,
                "models": {name: {"path": f"data/extra/{name}"} for name in models},
            }
        )
    )
    actions = SMALL["studies"]["study1"]["actions"]
    paths = {  # the development rule's files: the same job, and no plan or lock needed first
        (name, action): f"results/study1/{name}/dev/trajectories/{action}/ruler-1024.parquet"
        for name in models
        for action in actions
    }
    res = _snakemake(work, *paths.values(), "--configfile", str(override))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    low = min(models["eos-ab"])
    ended = 0
    for action in actions:
        ab, ba = (read_trajectories(work / paths[(name, action)]) for name in models)
        assert ab.equals(ba), action  # tokens, mismatch, δ, f, EOS flags: all identical
        assert read_trajectory_metadata(work / paths[("eos-ab", action)])["eos_ids"] == [
            tokenizer.eos_token_id,
            frequent,
        ]
        assert (ab.filter(pl.col("x_eos"))["x_token"] == low).all()
        assert (ab.filter(pl.col("y_eos"))["y_token"] == low).all()
        assert not ab.filter(pl.col("x_eos") & pl.col("y_eos"))["mismatch"].any()
        ended += ab["x_eos"].sum()
    assert ended > 0  # the added id ends sequences
    stats = [
        document_stats(
            {a: [work / paths[(name, a)]] for a in actions},
            [FIXTURE],
            control="full",
        )[0]
        for name in models
    ]
    assert stats[0].equals(stats[1])
