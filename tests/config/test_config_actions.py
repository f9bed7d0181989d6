"""Actions' labels and budget sweeps in the config (issue 31, items 1 and 5;
kvdiverge.config.actions): the expansion, its one-line refusals, the label kept out of the
action's spec, and the methods a study's sweep figure draws."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from kvdiverge.config import ConfigError, check_config
from kvdiverge.config.actions import (
    action_labels,
    actions_problem,
    budget_sweeps,
    selector_entry,
)
from kvdiverge.eviction import parse_action

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
BUDGETS = "a non-empty list of distinct budgets (fractions in (0, 1] or token counts >= 1)"
LABEL = "expected a non-empty string of at most 40 printable characters"


def swept_config() -> dict:
    """The default config with a SnapKV sweep and a labelled recent action in study 1."""
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["actions"]["snapkv-sweep"] = {
        "selector": "snapkv",
        "budgets": [0.25, 0.5, 0.75],
        "label": "SnapKV",
        "window": 16,
    }
    cfg["actions"]["recent-half"]["label"] = "recency, half the cache"
    cfg["studies"]["study1"]["actions"] = ["snapkv-sweep", "recent-half", "full"]
    cfg["studies"]["study1"]["baseline"] = "recent-half"
    cfg["analysis"]["contrasts"]["study1"] = [["snapkv-sweep@0.25", "recent-half"]]
    cfg["analysis"]["prediction"]["pairs"] = {}
    return cfg


def test_a_sweep_expands_into_one_action_per_budget():
    cfg = swept_config()
    check_config(cfg, SCHEMA)
    names = ["snapkv-sweep@0.25", "snapkv-sweep@0.5", "snapkv-sweep@0.75"]
    assert "snapkv-sweep" not in cfg["actions"]
    assert list(cfg["actions"])[-3:] == names  # in the sweep's place, budget order
    assert cfg["actions"]["snapkv-sweep@0.5"] == {
        "selector": "snapkv",
        "budget": 0.5,
        "label": "SnapKV@0.5",
        "window": 16,
    }
    assert cfg["studies"]["study1"]["actions"] == [*names, "recent-half", "full"]
    assert action_labels(cfg, cfg["studies"]["study1"]["actions"]) == {
        "snapkv-sweep@0.25": "SnapKV@0.25",
        "snapkv-sweep@0.5": "SnapKV@0.5",
        "snapkv-sweep@0.75": "SnapKV@0.75",
        "recent-half": "recency, half the cache",
        "full": "full",
    }
    # the expanded config is a plain one: checking it again changes nothing
    again = copy.deepcopy(cfg)
    check_config(again, SCHEMA)
    assert again == cfg
    # each expanded action parses as its budget; the label is no selector parameter, so it is
    # in no action spec, lock or trajectory metadata (relabelling reruns nothing)
    spec = parse_action(selector_entry(cfg["actions"]["snapkv-sweep@0.25"]), name=names[0])
    assert spec.as_dict() == {
        "name": names[0],
        "selector": "snapkv",
        "budget": 0.25,
        "window": 16,
        "kernel": 5,
    }


def test_a_sweep_in_a_rollout_group_names_all_its_actions():
    cfg = swept_config()
    cfg["studies"]["study1"]["groups"] = {
        "first": ["recent-half", "full"],
        "sweep": ["snapkv-sweep"],
    }
    check_config(cfg, SCHEMA)
    assert cfg["studies"]["study1"]["groups"]["sweep"] == [
        "snapkv-sweep@0.25",
        "snapkv-sweep@0.5",
        "snapkv-sweep@0.75",
    ]


def _set(path: str, value):
    def mutate(cfg):
        *head, last = path.split(".")
        node = cfg
        for key in head:
            node = node[key]
        node[last] = value

    return mutate


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            _set("actions.snapkv-sweep.budget", 0.5),
            "config.actions.snapkv-sweep: expected `budget` (one action) or `budgets` (a sweep), "
            "not both",
        ),
        (
            _set("actions.snapkv-sweep.budgets", [0.25, 1.5]),
            f"config.actions.snapkv-sweep.budgets: expected {BUDGETS}, got [0.25, 1.5]",
        ),
        (
            _set("actions.snapkv-sweep.budgets", [0.25, 0.25]),
            f"config.actions.snapkv-sweep.budgets: expected {BUDGETS}, got [0.25, 0.25]",
        ),
        (
            _set("actions.snapkv-sweep.budgets", [0, 64]),
            f"config.actions.snapkv-sweep.budgets: expected {BUDGETS}, got [0, 64]",
        ),
        (
            _set("actions.snapkv-sweep.budgets", []),
            "config.actions.snapkv-sweep.budgets: [] should be non-empty",
        ),
        (
            _set("actions.snapkv-sweep.budgets", 0.5),
            "config.actions.snapkv-sweep.budgets: expected array, got 0.5",
        ),
        (
            _set("actions.recent-half.label", ""),
            f"config.actions.recent-half.label: {LABEL}, got ''",
        ),
        (
            _set("actions.recent-half.label", 7),
            "config.actions.recent-half.label: expected string, got 7",
        ),
        (
            _set("actions.recent-half.label", "x" * 41),
            f"config.actions.recent-half.label: {LABEL}, got 41 characters ({'x' * 41!r})",
        ),
        (
            _set("actions.snapkv-sweep.label", "S" * 36),  # 36 + '@0.25' = 41
            f"config.actions.snapkv-sweep.label: {LABEL}, got 41 characters "
            f"({'S' * 36 + '@0.25'!r})",
        ),
        (
            _set("actions.recent-half.label", "recent - half"),
            "config.actions.recent-half.label: expected a label without ' - ' (it separates the "
            "two actions of a contrast), got 'recent - half'",
        ),
        (
            _set("actions.recent-half.label", "SnapKV@0.5"),
            "config.actions.snapkv-sweep.label: 'SnapKV@0.5' is also the label of action "
            "'recent-half'; expected a label unique across actions",
        ),
        (
            _set("actions.recent-half.label", "snapkv-half"),
            "config.actions.recent-half.label: 'snapkv-half' is also the name of action "
            "'snapkv-half'; expected a label unique across actions",
        ),
        (
            lambda c: c["actions"].update({"snapkv-sweep@0.5": {"selector": "recent"}}),
            "config.actions.snapkv-sweep: its budget 0.5 is named 'snapkv-sweep@0.5', which is "
            "already an action; rename one",
        ),
        (
            _set("studies.study1.baseline", "snapkv-sweep"),
            "config.studies.study1.baseline: 'snapkv-sweep' is a budget sweep; expected one "
            "action, e.g. 'snapkv-sweep@0.25'",
        ),
        (
            _set("actions.snapkv-sweep.budgets", [0.25, 0.01]),  # 1% of 736 tokens < window 16
            "config.actions.snapkv-sweep@0.01: in stratum helmet-768",
        ),
    ],
)
def test_bad_labels_and_sweeps_are_one_line(mutate, message):
    cfg = swept_config()
    mutate(cfg)
    with pytest.raises(ConfigError) as err:
        check_config(cfg, SCHEMA)
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(message) if message.endswith("helmet-768") else text == message


def test_no_sweep_no_label_changes_nothing():
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    before = copy.deepcopy(cfg)
    assert actions_problem(cfg) is None
    assert cfg == before
    for study in cfg["studies"]:
        # snapkv-512 (tokens) and snapkv-half (a fraction) are budgets of two kinds: no sweep
        assert budget_sweeps(cfg, study) == {}


def test_the_methods_of_a_study_at_two_budgets_or_more():
    cfg = swept_config()
    cfg["actions"] |= {
        "r25": {"selector": "recent", "budget": 0.25, "sinks": 2},
        "r75": {"selector": "recent", "budget": 0.75, "sinks": 2},
        "r75-again": {"selector": "recent", "budget": 0.75, "sinks": 2},
        "r-plain": {"selector": "recent", "budget": 0.25},  # another method: one budget
        "s128": {"selector": "snapkv", "budget": 128},
        "s256": {"selector": "snapkv", "budget": 256},  # token counts: left out beside fractions
    }
    cfg["studies"]["study1"]["actions"] = [
        "snapkv-sweep", "r25", "r-plain", "r75", "r75-again", "s128", "s256", "full",
    ]  # fmt: skip
    cfg["studies"]["study1"]["baseline"] = "r-plain"
    del cfg["analysis"]["contrasts"]["study1"]  # every pair, earlier minus later
    check_config(cfg, SCHEMA)
    assert budget_sweeps(cfg, "study1") == {
        "snapkv-sweep@0.25": ("SnapKV", 0.25),
        "snapkv-sweep@0.5": ("SnapKV", 0.5),
        "snapkv-sweep@0.75": ("SnapKV", 0.75),
        "r25": ("recent+sinks=2", 0.25),
        "r75": ("recent+sinks=2", 0.75),
    }
    cfg["studies"]["study1"]["actions"] = ["s128", "s256", "full"]
    del cfg["studies"]["study1"]["baseline"]
    assert budget_sweeps(cfg, "study1") == {"s128": ("snapkv", 128), "s256": ("snapkv", 256)}


@pytest.mark.slow
def test_a_study_with_a_sweep_plans_its_sweep_figure(tmp_path):
    """The tiny config with a sweep in study 1: its three actions' rollouts and the sweep
    figure are planned; study 2, with no method at two budgets, gets no sweep figure."""
    from workflow_helpers import planned_jobs, run_snakemake, workflow_copy

    work = workflow_copy(tmp_path)
    extra = tmp_path / "sweep.yaml"
    extra.write_text(
        yaml.safe_dump(
            {
                "actions": {
                    "snapkv-sweep": {"selector": "snapkv", "budgets": [0.25, 0.5, 0.75]},
                    "recent-half": {"selector": "recent", "budget": 0.5, "label": "recency"},
                },
                "studies": {
                    "study3": {
                        "actions": ["snapkv-sweep", "recent-half", "full"],
                        "cohort": "study1",
                        "baseline": "recent-half",
                        "K_dev": 2,
                        "K_control": 2,
                    }
                },
            }
        )
    )
    res = run_snakemake(work, "-n", "--configfile", str(extra))
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-3000:]
    jobs = planned_jobs(res)
    assert jobs["study_sweep_figure"] == 1
    assert "study3/figures/budget_sweep.png" in text and "study1/figures/budget_sweep" not in text
    assert "study3/tiny-llama/trajectories/snapkv-sweep@0.25/" in text
