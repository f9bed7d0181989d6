"""Rollout groups (issue 16, "Adding a method reruns nothing else"; docs/compare.md, "Rollout
groups"): a study's actions split into groups, one evaluation job per group, each with the
reference stream X. Under common random numbers X and every action's trajectory do not depend
on which other actions share the job; the groups' config is checked at parse time."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
import torch
import yaml
from workflow_helpers import fixture_stratum_config, place_fixture_documents

from kvdiverge.config import ConfigError, action_groups, check_config, study_groups
from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
DOCUMENTS = ROOT / "tests" / "data" / "documents" / "ruler-1024.parquet"
MODEL = {"name": "tiny-llama", "path": str(ROOT / "data" / "models" / "tiny-llama")}
ACTIONS = {
    "snapkv-half": {"selector": "snapkv", "budget": 0.5, "window": 16},
    "recent-half": {"selector": "recent", "budget": 0.5},
    "full": {"selector": "full"},
}
COHORTS = {"snapkv-half": {"study1": 3}, "recent-half": {"study1": 3}, "full": {"study1": 2}}
TOKENS = ("x_token", "y_token", "x_eos", "y_eos", "n_prompt", "n_kept")
LAWS = ("tv_rollout", "tv_fixed")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _job(folder: Path, names: list[str]) -> dict[str, pl.DataFrame]:
    return run_stratum_rollout_job(
        DOCUMENTS,
        {name: folder / f"{name}.parquet" for name in names},
        MODEL,
        {name: ACTIONS[name] for name in names},
        {name: COHORTS[name] for name in names},
        RolloutSettings(H=8, seed=3),
        device="cpu",
    )


@pytest.mark.slow
def test_a_split_into_groups_gives_the_same_reference_and_trajectories(tmp_path, one_thread):
    """One job of all three actions against two jobs (snapkv-half with the control, recent-half
    alone): the reference tokens X are the same path by path in every file of both splits, and
    each action's file has the same tokens, EOS flags and prompt sizes, its δ and f equal to
    float rounding (the model calls' batches differ, docs/architecture.md "Coupled decoding")."""
    whole = _job(tmp_path / "one", list(ACTIONS))
    split = {
        **_job(tmp_path / "main", ["snapkv-half", "full"]),
        **_job(tmp_path / "extra", ["recent-half"]),
    }
    keys = ["doc_id", "replicate", "t"]
    for name, frame in whole.items():
        other = split[name]
        assert frame.height == other.height > 0
        assert frame.select(keys).equals(other.select(keys))
        for column in TOKENS:
            assert frame[column].equals(other[column]), (name, column)
        for column in LAWS:
            assert (frame[column] - other[column]).abs().max() < 1e-5, (name, column)
    # X across groups: recent-half's job (no other action) has the X of snapkv-half's job, and
    # of the control for the replicates the control runs
    reference = split["snapkv-half"].select(*keys, "x_token")
    joined = split["recent-half"].join(reference, on=keys, suffix="_main")
    assert joined.height == reference.height
    assert (joined["x_token"] == joined["x_token_main"]).all()
    control = split["full"].join(split["recent-half"], on=keys, suffix="_extra")
    assert control.height == split["full"].height > 0
    assert (control["x_token"] == control["x_token_extra"]).all()
    assert split["recent-half"]["mismatch"].any()  # X and Y do split: a real comparison


# ---- the groups' config -------------------------------------------------------------------------
def _tiny() -> dict:
    return yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())


def _groups(pair: list[str] | None = None, **groups):
    """Study 1 of three actions split into ``groups``: one contrast, and a prediction pair only
    when given."""

    def mutate(cfg: dict) -> None:
        study = cfg["studies"]["study1"]
        study["actions"] = ["snapkv-half", "recent-half", "full"]
        study["groups"] = groups
        cfg["analysis"]["contrasts"]["study1"] = [["recent-half", "snapkv-half"]]
        del cfg["analysis"]["prediction"]["pairs"]["study1"]
        if pair:
            cfg["analysis"]["prediction"]["pairs"]["study1"] = pair

    return mutate


def test_groups_split_a_study_and_default_to_one():
    cfg = _tiny()
    check_config(cfg, SCHEMA)
    assert study_groups(cfg, "study1") == {"main": cfg["studies"]["study1"]["actions"]}
    cfg = _tiny()
    _groups(first=["full", "snapkv-half"], extra=["recent-half"])(cfg)
    check_config(cfg, SCHEMA)
    # in the study's action order within a group, the groups in config order
    assert study_groups(cfg, "study1") == {
        "first": ["snapkv-half", "full"],
        "extra": ["recent-half"],
    }
    assert action_groups(cfg, "study1") == {
        "snapkv-half": "first",
        "full": "first",
        "recent-half": "extra",
    }


GROUP_CASES = {
    "action of no study in a group": (
        _groups(main=["snapkv-half", "full"], extra=["recent-half", "snapkv-512"]),
        "config.studies.study1.groups.extra: 'snapkv-512' is not one of the study's actions "
        "(snapkv-half, recent-half, full)",
    ),
    "action in two groups": (
        _groups(main=["snapkv-half", "recent-half", "full"], extra=["recent-half"]),
        "config.studies.study1.groups.extra: 'recent-half' is already in group 'main'; an "
        "action belongs to one group",
    ),
    "action in no group": (
        _groups(main=["snapkv-half", "full"]),
        "config.studies.study1.groups: action(s) recent-half in no group; expected every action "
        "of the study in one group",
    ),
    "empty group": (
        _groups(main=["snapkv-half", "recent-half", "full"], extra=[]),
        "config.studies.study1.groups.extra: [] should be non-empty",
    ),
    "control in a later group": (
        _groups(main=["snapkv-half", "recent-half"], extra=["full"]),
        "config.studies.study1.groups.extra: holds the control 'full', which belongs in the "
        "first group 'main'",
    ),
    "first group of the control alone": (
        _groups(main=["full"], extra=["snapkv-half", "recent-half"]),
        "config.studies.study1.groups.main: expected at least one action besides the control "
        "'full' (the first group's development rollouts plan the study's K)",
    ),
    "group name unfit for a path": (  # the names' pattern: kvdiverge.config.names
        _groups(**{"main": ["snapkv-half", "recent-half", "full"], "my/extra": ["x"]}),
        "config.studies.study1.groups.my/extra: expected a name matching "
        "^[A-Za-z0-9][A-Za-z0-9_.+=@-]*$ without '..'",
    ),
    "prediction pair with an action of a later group": (
        _groups(
            ["recent-half", "snapkv-half"], main=["snapkv-half", "full"], extra=["recent-half"]
        ),
        "config.analysis.prediction.pairs.study1: 'recent-half' is in rollout group 'extra', but "
        "prediction is fitted on the development rollouts, which only the first group ('main') "
        "runs",
    ),
}


@pytest.mark.parametrize("case", list(GROUP_CASES))
def test_a_bad_group_stops_at_parse_time_with_one_line(case):
    mutate, expected = GROUP_CASES[case]
    cfg = _tiny()
    mutate(cfg)
    with pytest.raises(ConfigError) as info:
        check_config(cfg, SCHEMA)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(expected), message


# ---- the workflow: appending a group reruns nothing of the others -------------------------------
def _config(groups: dict | None) -> dict:
    """Study 1 on the fixture's stratum, small H, K and bootstrap; with ``groups``, recent-90
    appended in a later group."""
    actions = ["snapkv-half", "recent-half", "full"]
    study = {"actions": actions, "K": "plan", "K_dev": 2, "K_control": 1, "bootstrap_draws": 2000}
    if groups:
        study["actions"] = [a for members in groups.values() for a in members]
        study["groups"] = groups
    return fixture_stratum_config(H=8, max_K=2, studies={"study1": study})


@pytest.mark.slow
def test_an_action_appended_in_a_new_group_reruns_only_that_group(tmp_path):
    """Study 1 run through its estimands with one group (the default); then recent-90 appended
    in a group `extra`: a dry run schedules only the group's amendment lock and evaluation jobs
    and the analysis after them. Run, the study lock and the first group's files stay as they
    were; the new files carry the amendment's hash and the study's K, and their X is the first
    group's path by path. An edit of the new action reruns its group alone."""

    from workflow_helpers import planned_jobs, run_snakemake, workflow_copy

    from kvdiverge.analysis.prespecification import read_lock
    from kvdiverge.io.trajectories import read_trajectories, read_trajectory_metadata

    work = workflow_copy(tmp_path)
    place_fixture_documents(work)
    models = ["tiny-llama"]  # one model keeps the test short; the groups are per study
    base = yaml.safe_load((work / "config.yaml").read_text())
    base["models"] = {m: base["models"][m] for m in models}
    (work / "config.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    first = ["snapkv-half", "recent-half", "full"]
    rules = [
        "dev_rollout_study1",
        "plan_sample_sizes",
        "prespecify",
        "prespecify_group",
        "rollout_study1",
        "rollout_study1_extra",
        "document_stats",
        "estimands",
    ]

    def trajectory(model: str, action: str) -> Path:
        return work / f"results/study1/{model}/trajectories/{action}/ruler-1024.parquet"

    def snakemake(config: dict, *args: str):
        path = tmp_path / "override.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))  # the groups in order
        res = run_snakemake(
            work,
            "results/study1/tables/estimands.csv",
            *args,
            "--allowed-rules",
            *rules,
            "--configfile",
            str(path),
            timeout=900,
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        return res

    snakemake(_config(None))
    lock_path = work / "results/study1/lock.json"
    lock = read_lock(lock_path)
    assert sorted(lock["design"]["actions"]) == sorted(first)
    before = {
        (m, a): (trajectory(m, a).stat().st_mtime_ns, read_trajectories(trajectory(m, a)))
        for m in models
        for a in first
    }
    lock_text = lock_path.read_text()

    grouped = _config({"main": first, "extra": ["recent-90"]})
    group_jobs = {  # the new group's amendment and rollouts, and the analysis after them
        "prespecify_group": 1,
        "rollout_study1_extra": len(models),
        "document_stats": len(models),
        "estimands": 1,
    }
    planned = planned_jobs(snakemake(grouped, "-n"))
    assert planned == group_jobs, planned
    snakemake(grouped)
    assert lock_path.read_text() == lock_text
    amendment = read_lock(work / "results/study1/locks/extra.json")
    assert amendment["study_lock"] == lock["hash"] and amendment["group"] == "extra"
    assert amendment["design"]["K"] == lock["design"]["K"]
    assert list(amendment["design"]["actions"]) == ["recent-90"]
    keys = ["doc_id", "replicate", "t"]
    for model in models:
        for action in first:
            mtime, frame = before[(model, action)]
            assert trajectory(model, action).stat().st_mtime_ns == mtime
            assert read_trajectories(trajectory(model, action)).equals(frame)
        meta = read_trajectory_metadata(trajectory(model, "recent-90"))
        assert meta["lock"] == amendment["hash"]
        assert meta["K"] == {"study1": lock["design"]["K"]}
        added = read_trajectories(trajectory(model, "recent-90"))
        main = before[(model, "snapkv-half")][1].select(*keys, "x_token")
        joined = added.join(main, on=keys, suffix="_main")
        assert joined.height == added.height == main.height > 0
        assert (joined["x_token"] == joined["x_token_main"]).all()  # the same reference X
    table = pl.read_csv(work / "results/study1/tables/estimands.csv")
    assert "recent-90" in set(table["action"])

    # an edit of the appended action re-locks and reruns its group, nothing of the first
    grouped["actions"] = {"recent-90": {"selector": "recent", "budget": 0.8}}
    planned = planned_jobs(snakemake(grouped, "-n"))
    assert planned == group_jobs, planned


def test_the_lock_rules_reach_no_method_code():
    """The plan, lock and amendment scripts' code fingerprints (kvdiverge.pipeline.provenance)
    cover no
    selector module nor the config checks that import them: editing a method re-locks no study
    (the groups come from kvdiverge.analysis.groups, which imports nothing of the package)."""
    from kvdiverge.pipeline.provenance import imported_modules

    scripts = ROOT / "workflow" / "scripts"
    for script in ("plan_sample_sizes.py", "prespecify.py"):
        reached = imported_modules([scripts / script])
        assert "kvdiverge.analysis.prespecification" in reached or script.startswith("plan")
        assert not {
            "kvdiverge.eviction",
            "kvdiverge.eviction.kvpress_bridge",
        } & set(reached), (script, reached)
        assert not [m for m in reached if m.startswith("kvdiverge.config")], (script, reached)
