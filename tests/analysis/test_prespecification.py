"""The development stage comes first and the endpoints are locked (docs/prespecification.md,
"Prespecification"):
the lock's content and hash, its refusals, and the order of the jobs in a fresh default. The
plan's K in real evaluation trajectories is tested with the rollout rules
(tests/workflow/test_workflow_rollout.py), the estimands step stopping when an endpoint changes
after the evaluation with the analysis rules (tests/workflow/test_analysis_workflow.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from registration_helpers import file_meta, rollout_models
from workflow_helpers import ROOT, run_snakemake, workflow_copy

from kvdiverge.analysis.prespecification import (
    PrespecificationError,
    check_lock,
    evaluation_cohorts,
    first_difference,
    make_amendment,
    make_lock,
    prespecified,
    prespecified_group,
    read_lock,
    register,
    write_lock,
)
from kvdiverge.config import validate_config
from kvdiverge.eviction import parse_action

SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
PLAN = {"study": "study2", "K": 5, "K_planned": 5, "K_source": "plan", "notes": [], "plans": []}


def _config(path: Path = ROOT / "config.yaml") -> dict:
    config = yaml.safe_load(path.read_text())
    validate_config(config, SCHEMA)  # fills the defaults
    return config


def _spec(config: dict, study: str = "study2") -> dict:
    actions = {
        name: parse_action(spec, name=name).as_dict() for name, spec in config["actions"].items()
    }
    strata = [f"{s['env']}-{s['label']}" for s in config["datasets"]["strata"]]
    return prespecified(config, study, strata, actions)


# ---- the lock itself ---------------------------------------------------------------------------
def test_the_lock_records_the_family_its_settings_and_the_plan():
    config = _config()
    lock = make_lock(_spec(config), PLAN)
    design, endpoints = lock["design"], lock["endpoints"]
    assert design["K_setting"] == "plan" and design["K"] == PLAN["K_planned"]
    assert design["cohort"] == "study2" and design["documents_per_stratum"] == 2
    assert design["actions"]["snapkv-90"]["budget"] == 0.9 and design["K_control"] == 2
    # study 2's family: S_.99 and B(a) for every model and non-control action, at 1 − α/m
    assert endpoints["estimands"] == ["S_99", "branch_contrast_B"]
    assert endpoints["family"] == [
        {"model": "smollm2", "action": a, "estimand": e}
        for a in ("snapkv-90", "recent-90")
        for e in ("S_99", "branch_contrast_B")
    ]
    assert endpoints["family_size"] == 8 and endpoints["level"] == pytest.approx(1 - 0.05 / 8)
    assert endpoints["clock"] == config["analysis"]["clock"]
    assert lock["plan"] == PLAN and re.fullmatch(r"[0-9a-f]{16}", lock["hash"])
    # an exploratory study locks its design and plan, no endpoints
    assert make_lock(_spec(config, "study1"), PLAN)["endpoints"] is None
    # a pinned K wins over the plan's
    config["studies"]["study2"]["K"] = 7
    assert make_lock(_spec(config), PLAN)["design"]["K"] == 7
    assert evaluation_cohorts(make_lock(_spec(config), PLAN)) == {
        "snapkv-90": {"study2": 7},
        "recent-90": {"study2": 7},
        "full": {"study2": 2},
    }


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: c["analysis"].update(family_estimands=["S_99"]),
        lambda c: c["analysis"]["clock"].update(saturation=0.95),
        lambda c: c["analysis"].update(alpha=0.1),
        lambda c: c["studies"]["study2"].update(family_endpoints=9),
        lambda c: c["studies"]["study2"].update(bootstrap_draws=20000),
        lambda c: c["studies"]["study2"].update(K=4),
        lambda c: c["actions"]["recent-90"].update(budget=0.8),
    ],
)
def test_every_prespecified_setting_changes_the_hash(edit):
    config = _config()
    before = make_lock(_spec(config), PLAN)["hash"]
    edit(config)
    assert make_lock(_spec(config), PLAN)["hash"] != before
    assert make_lock(_spec(config), {**PLAN, "K_planned": 6})["hash"] != before


def test_settings_outside_the_lock_leave_it_alone():
    """The pointwise level, the contrasts, prediction and figures are not endpoints."""
    config = _config()
    before = make_lock(_spec(config), PLAN)["hash"]
    config["analysis"]["level"] = 0.9
    config["analysis"]["contrasts"]["study2"] = []
    config["figures"]["main_contrast"] = {"study2": ["recent-90", "snapkv-90"]}
    assert make_lock(_spec(config), PLAN)["hash"] == before


def test_a_lock_reads_back_and_refuses_a_hand_edit(tmp_path):
    lock = make_lock(_spec(_config()), PLAN)
    write_lock(lock, tmp_path / "lock.json")
    assert read_lock(tmp_path / "lock.json") == lock
    edited = json.loads((tmp_path / "lock.json").read_text())
    edited["design"]["K"] = 1
    (tmp_path / "lock.json").write_text(json.dumps(edited))
    with pytest.raises(PrespecificationError, match=r"does not match its hash .* \(edited by hand"):
        read_lock(tmp_path / "lock.json")
    (tmp_path / "lock.json").write_text("{")
    with pytest.raises(PrespecificationError, match=r"lock\.json: not a readable lock"):
        read_lock(tmp_path / "lock.json")
    (tmp_path / "lock.json").write_text(json.dumps({"study": "x"}))
    with pytest.raises(PrespecificationError, match="lock lacks field"):
        read_lock(tmp_path / "lock.json")


def test_check_lock_names_the_changed_field_or_the_file(tmp_path):
    config = _config()
    path = tmp_path / "lock.json"
    lock = register(make_lock(_spec(config), PLAN, models=rollout_models(config["models"])), path)
    files = {
        "a.parquet": file_meta(lock, "snapkv-90", "smollm2"),
        "b.parquet": file_meta(lock, "recent-90", "smollm2"),
    }
    assert check_lock(path, _spec(config), files) == lock
    config["analysis"]["family_estimands"] = ["S_99"]
    with pytest.raises(PrespecificationError) as info:
        check_lock(path, _spec(config), files)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f'{path}: the config no longer matches the lock (endpoints.estimands: locked ["S_99", '
        '"branch_contrast_B"], now ["S_99"]); rerun the workflow to re-lock'
    )
    stale = {**files, "b.parquet": {**files["b.parquet"], "lock": "0123456789abcdef"}}
    with pytest.raises(PrespecificationError, match=r"^b\.parquet: rolled out under lock 0123"):
        check_lock(path, _spec(_config()), stale)
    with pytest.raises(PrespecificationError, match=r"^a\.parquet: rolled out under no lock"):
        check_lock(path, _spec(_config()), {"a.parquet": {"action": {"name": "snapkv-90"}}})


# ---- rollout groups: the study lock covers the first, each later group an amendment ------------
def _actions(config: dict) -> dict:
    actions = config["actions"]
    return {name: parse_action(spec, name=name).as_dict() for name, spec in actions.items()}


def _grouped(config: dict, **groups: list[str]) -> dict:
    """Study 2 with ``groups`` (set after validation: the defaults are filled already)."""
    study = config["studies"]["study2"]
    study["actions"] = [a for members in groups.values() for a in members]
    study["groups"] = groups
    return config


def test_appending_a_group_leaves_the_study_lock_and_earlier_amendments_alone():
    """The first group's lock is the study lock, the same as that of a config without the later
    groups (and without `groups`); each later group's amendment holds the locked K, its actions
    and their family endpoints, and does not change when a group is appended after it."""
    alone = _config()
    alone["studies"]["study2"]["actions"] = ["snapkv-90", "full"]
    before = make_lock(_spec(alone), PLAN)
    config = _grouped(_config(), main=["snapkv-90", "full"], extra=["recent-90"])
    lock = make_lock(_spec(config), PLAN)
    assert lock == before
    assert list(lock["design"]["actions"]) == ["snapkv-90", "full"]
    assert {e["action"] for e in lock["endpoints"]["family"]} == {"snapkv-90"}
    spec = prespecified_group(config, "study2", "extra", _actions(config))
    amendment = make_amendment(spec, lock)
    assert amendment["study_lock"] == lock["hash"] and amendment["group"] == "extra"
    assert amendment["design"]["K"] == lock["design"]["K"] == PLAN["K_planned"]
    assert amendment["design"]["K_setting"] == "plan"
    assert list(amendment["design"]["actions"]) == ["recent-90"]
    assert amendment["endpoints"]["family"] == [
        {"model": "smollm2", "action": "recent-90", "estimand": e}
        for e in ("S_99", "branch_contrast_B")
    ]
    assert {k: v for k, v in amendment["endpoints"].items() if k != "family"} == {
        k: v for k, v in lock["endpoints"].items() if k != "family"
    }
    assert evaluation_cohorts(amendment) == {"recent-90": {"study2": PLAN["K_planned"]}}
    # a third group appended: the study lock and the first amendment stay as they were
    config["actions"]["recent-80"] = {"selector": "recent", "budget": 0.8}
    config = _grouped(config, main=["snapkv-90", "full"], extra=["recent-90"], more=["recent-80"])
    assert make_lock(_spec(config), PLAN) == lock
    spec = prespecified_group(config, "study2", "extra", _actions(config))
    assert make_amendment(spec, lock) == amendment
    more = make_amendment(prespecified_group(config, "study2", "more", _actions(config)), lock)
    assert more["hash"] != amendment["hash"] and list(more["design"]["actions"]) == ["recent-80"]
    # the default: one group holding every action, whose lock covers them all
    assert list(make_lock(_spec(_config()), PLAN)["design"]["actions"]) == [
        "snapkv-90",
        "recent-90",
        "full",
    ]
    with pytest.raises(PrespecificationError, match=r"no later rollout group 'main' \(later"):
        prespecified_group(config, "study2", "main", _actions(config))
    with pytest.raises(PrespecificationError, match="no later rollout group 'nope'"):
        prespecified_group(config, "study2", "nope", _actions(config))


def test_check_lock_checks_every_amendment_and_each_file_against_its_group(tmp_path):
    config = _grouped(_config(), main=["snapkv-90", "full"], extra=["recent-90"])
    path, extra = tmp_path / "lock.json", tmp_path / "locks" / "extra.json"
    models = rollout_models(config["models"])
    lock = register(make_lock(_spec(config), PLAN, models=models), path)
    spec = prespecified_group(config, "study2", "extra", _actions(config))
    amendment = make_amendment(spec, lock)
    extra.parent.mkdir()
    write_lock(amendment, extra)
    assert read_lock(extra) == amendment

    def amendments(cfg: dict) -> dict:
        return {"extra": (extra, prespecified_group(cfg, "study2", "extra", _actions(cfg)))}

    files = {
        "snapkv.parquet": file_meta(lock, "snapkv-90", "smollm2"),
        "full.parquet": file_meta(lock, "full", "smollm2"),
        "recent.parquet": file_meta(amendment, "recent-90", "smollm2"),
    }
    assert check_lock(path, _spec(config), files, amendments(config)) == lock
    # a file of the later group rolled out under the study lock, and the other way round
    for name, wrong, owner in (
        ("recent.parquet", lock["hash"], extra),
        ("snapkv.parquet", amendment["hash"], path),
    ):
        stale = {**files, name: {**files[name], "lock": wrong}}
        with pytest.raises(PrespecificationError) as info:
            check_lock(path, _spec(config), stale, amendments(config))
        message = str(info.value)
        assert "\n" not in message
        assert message.startswith(f"{name}: rolled out under lock {wrong}, but its lock {owner}")
    # an edited action of the later group: the amendment no longer holds, the lock still does
    config["actions"]["recent-90"]["budget"] = 0.8
    with pytest.raises(PrespecificationError) as info:
        check_lock(path, _spec(config), files, amendments(config))
    assert str(info.value).startswith(
        f"{extra}: the config no longer matches the lock (design.actions.recent-90.budget: "
        "locked 0.9, now 0.8)"
    )
    # a re-locked study (another K): the amendment names the study lock it was written under
    config["actions"]["recent-90"]["budget"] = 0.9
    register(make_lock(_spec(config), {**PLAN, "K_planned": 6}, models=models), path)
    with pytest.raises(PrespecificationError, match=r"extra\.json: the config no longer matches "):
        check_lock(path, _spec(config), {}, amendments(config))
    # an amendment edited by hand is refused when read
    edited = json.loads(extra.read_text())
    edited["design"]["K"] = 1
    extra.write_text(json.dumps(edited))
    with pytest.raises(PrespecificationError, match="does not match its hash"):
        read_lock(extra)


def test_first_difference_walks_mappings_and_lists():
    assert first_difference({"a": [1, {"b": 2}]}, {"a": [1, {"b": 3}]}) == ("a[1].b", 2, 3)
    assert first_difference({"a": [1]}, {"a": [1, 2]}) == ("a", [1], [1, 2])
    assert first_difference({"a": 1}, {"a": 1, "z": 2}) == ("z", None, 2)
    assert first_difference({"a": 1}, {"a": 1}) is None


# ---- the workflow's order -----------------------------------------------------------------------
def _dot_graph(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """Node labels and each node's direct parents from ``snakemake --dag`` output."""
    labels = dict(re.findall(r'^\s*(\d+)\[label = "([^"]*)"', text, flags=re.M))
    parents: dict[str, set[str]] = {node: set() for node in labels}
    for src, dst in re.findall(r"^\s*(\d+) -> (\d+)", text, flags=re.M):
        parents[dst].add(src)
    return labels, parents


def _ancestors(node: str, parents: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [node]
    while todo:
        for parent in parents[todo.pop()] - seen:
            seen.add(parent)
            todo.append(parent)
    return seen


@pytest.mark.slow
def test_a_fresh_default_plans_and_locks_before_every_evaluation_rollout(tmp_path):
    """`snakemake --dag` (a dry run) of a fresh default: each study's plan reads only its
    development rollouts, its lock follows the plan, and every evaluation rollout of the study
    waits for the lock."""
    work = workflow_copy(tmp_path, config="default")
    res = run_snakemake(work, "--dag")
    assert res.returncode == 0, res.stderr[-3000:]
    labels, parents = _dot_graph(res.stdout)
    rule = {node: label.split("\\n")[0] for node, label in labels.items()}
    config = _config()
    jobs = len(config["models"]) * len(config["datasets"]["strata"])
    for study in config["studies"]:
        (plan,) = [n for n, lb in labels.items() if lb == f"plan_sample_sizes\\nstudy: {study}"]
        assert sorted(rule[p] for p in parents[plan]) == [f"dev_rollout_{study}"] * jobs
        assert not any(rule[a].startswith("rollout_") for a in _ancestors(plan, parents))
        (lock,) = [n for n in labels if rule[n] == "prespecify" and plan in parents[n]]
        evaluation = [n for n in labels if rule[n] == f"rollout_{study}"]
        assert len(evaluation) == jobs
        for node in evaluation:
            assert lock in parents[node]
            assert not any(rule[a].startswith("rollout_") for a in _ancestors(node, parents))


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda c: c["studies"]["study2"].update(K="planned"),
            "config.studies.study2.K: expected an integer >= 1 or 'plan', got 'planned'",
        ),
        (
            lambda c: c["studies"]["study2"].update(K_dev=1),
            "config.studies.study2.K_dev: expected a value >= 2, got 1",
        ),
        (  # a pinned K still has its plan made and locked beside it
            lambda c: c["studies"]["study2"].update(K=4, K_dev=1),
            "config.studies.study2.K_dev: expected a value >= 2, got 1",
        ),
        (
            lambda c: c["datasets"]["cohorts"].update(dev=1),
            "config.datasets.cohorts.dev: 1 document per stratum, but study 'study1' plans its "
            "evaluation from the variance between development documents within a stratum",
        ),
        (
            lambda c: c["studies"]["study2"].update(family_endpoints=3),
            "config.studies.study2.family_endpoints: 3, but the study's family has 4 endpoints",
        ),
    ],
)
def test_a_study_that_cannot_be_planned_or_locked_stops_at_parse_time(edit, message):
    from kvdiverge.config import ConfigError, check_config

    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    edit(config)
    with pytest.raises(ConfigError) as info:
        check_config(config, SCHEMA)
    assert str(info.value).startswith(message), str(info.value)
