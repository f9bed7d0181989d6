"""Rollout groups (issue 16, "Adding a method reruns nothing else"; README "Compare your own
method"): a study's actions split into groups, one evaluation job per group, each with the
reference stream X. Under common random numbers X and every action's trajectory do not depend
on which other actions share the job; the groups' config is checked at parse time."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
import torch
import yaml

from kvdiverge.config import ConfigError, action_groups, check_config, study_groups
from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job

ROOT = Path(__file__).resolve().parents[1]
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
    "group name unfit for a rule": (
        _groups(**{"main": ["snapkv-half", "recent-half", "full"], "my-extra": ["x"]}),
        "config.studies.study1.groups: 'my-extra' does not match",
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
