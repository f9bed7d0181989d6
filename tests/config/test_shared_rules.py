"""The rules the pipeline's config and ``kvdiverge compare`` share come from one place
(kvdiverge.config): a decoding temperature (``rollout.temperature`` and ``--temperature``), a
sweep's budgets (``actions.<name>.budgets`` and ``--budgets``) and an action's label
(``actions.<name>.label`` and ``--actions LABEL=...``) are refused in the same cases, each with
its own field's name; a baseline's paired grid (``studies.<study>.baseline`` and
``--baseline`` with ``--budgets``) pairs the same actions."""

from __future__ import annotations

import math

import pytest

from kvdiverge.compare import CompareError
from kvdiverge.compare.actions import (
    baseline_method,
    contrast_pairs,
    parse_actions,
    parse_budgets,
    sweep_budgets,
    with_baseline,
)
from kvdiverge.compare.inputs import check_numbers
from kvdiverge.config import (
    MAX_LABEL,
    actions_problem,
    baseline_pairs,
    decoding_problem,
    is_budget,
)

TEMPERATURES = [0, 0.0, 0.7, 1, 2.5, -1, -0.5, math.inf, math.nan, True, "1"]


@pytest.mark.parametrize("T", TEMPERATURES, ids=repr)
def test_a_temperature_is_refused_by_both_or_neither(T):
    pipeline = decoding_problem({"rollout": {"temperature": T}})
    try:
        check_numbers(K=1, H=8, draws=100, level=0.95, temperature=T)
        compare = None
    except CompareError as exc:
        compare = str(exc)
    finite = isinstance(T, int | float) and not isinstance(T, bool) and math.isfinite(T)
    if finite and T >= 0:
        assert pipeline is None and compare is None
    else:
        assert pipeline == (
            f"config.rollout.temperature: expected a finite number >= 0 (0: greedy), got {T!r}"
        )
        assert compare == pipeline.replace("config.rollout.temperature", "--temperature")


BUDGETS = [0.25, 1.0, 1, 512, 0.0, 1.5, 0, -3, True, "0.5", None]


@pytest.mark.parametrize("b", BUDGETS, ids=repr)
def test_a_budget_is_refused_by_both_or_neither(b):
    config = {"actions": {"s": {"selector": "snapkv", "budgets": [b]}}}
    pipeline = actions_problem(config)
    try:
        parse_budgets([b])
        compare = None
    except CompareError as exc:
        compare = str(exc)
    good = (isinstance(b, float) and 0 < b <= 1) or (
        isinstance(b, int) and not isinstance(b, bool) and b >= 1
    )
    assert is_budget(b) is good
    if good:
        assert pipeline is None and compare is None
        assert config["actions"] == {f"s@{b!r}": {"selector": "snapkv", "budget": b}}
    else:
        assert pipeline is not None and pipeline.startswith("config.actions.s.budgets: expected")
        assert compare is not None and compare.startswith("--budgets: expected")


LABELS = ["x" * 40, "x" * 41, "y" * 80, "a\tb", "recent - half", "recency (half)", "a-b", "é"]


@pytest.mark.parametrize("label", LABELS, ids=repr)
def test_a_label_is_refused_by_both_or_neither(label):
    """One limit (40 characters, what docs/configuration.md and the schema state) and one line:
    compare's differs from the config's only in naming its option."""
    assert MAX_LABEL == 40
    pipeline = actions_problem(
        {"actions": {"s": {"selector": "recent", "budget": 0.5, "label": label}}}
    )
    try:
        parse_actions(f"{label}=recent@0.5")
        compare = None
    except CompareError as exc:
        compare = str(exc)
    good = len(label) <= 40 and label.isprintable() and " - " not in label
    if good:
        assert pipeline is None and compare is None
        return
    assert pipeline is not None and pipeline.startswith("config.actions.s.label: expected")
    assert compare == pipeline.replace("config.actions.s.label", "--actions label")
    if len(label) > 40:
        assert compare == (
            "--actions label: expected a non-empty string of at most 40 printable characters, "
            f"got {len(label)} characters ({label!r})"
        )


def test_a_swept_label_is_held_to_the_same_limit():
    """A sweep's ``LABEL@b`` is checked as expanded by both: 36 + ``@0.25`` = 41 characters."""
    label = "S" * 36
    config = {"actions": {"s": {"selector": "recent", "budgets": [0.25], "label": label}}}
    pipeline = actions_problem(config)
    actions = parse_actions(f"{label}=recent@0.5")
    with pytest.raises(CompareError) as err:
        sweep_budgets(actions, parse_budgets("0.25"), None)
    assert pipeline == (
        "config.actions.s.label: expected a non-empty string of at most 40 printable "
        f"characters, got 41 characters ('{label}@0.25')"
    )
    assert str(err.value) == pipeline.replace("config.actions.s.label", "--budgets label")


def _study(actions: dict, baseline: str) -> dict:
    """A study of ``actions`` and the control, its sweeps expanded (``<name>@<budget>``)."""
    config = {
        "actions": {**actions, "full": {"selector": "full"}},
        "studies": {"s": {"actions": [*actions, "full"], "baseline": baseline}},
    }
    assert actions_problem(config) is None
    return config


@pytest.mark.parametrize(
    "compare_args, config_actions, config_baseline, want",
    [
        (  # a paired grid: each action against the baseline at its own budget
            ("mine=recent@0.5,snapkv=snapkv@0.5", "snapkv", "0.25,0.5"),
            {
                "mine": {"selector": "recent", "budgets": [0.25, 0.5]},
                "snapkv": {"selector": "snapkv", "budgets": [0.25, 0.5]},
            },
            "snapkv@0.25",
            {"mine@0.25": "snapkv@0.25", "mine@0.5": "snapkv@0.5"},
        ),
        (  # no sweep: every action against the baseline as named
            ("mine=recent@0.5,snapkv=snapkv@0.5,other=recent@0.25", "snapkv", None),
            {
                "mine": {"selector": "recent", "budget": 0.5},
                "snapkv": {"selector": "snapkv", "budget": 0.5},
                "other": {"selector": "recent", "budget": 0.25},
            },
            "snapkv",
            {"mine": "snapkv", "other": "snapkv"},
        ),
    ],
)
def test_a_paired_grid_pairs_the_same_actions_in_both(
    compare_args, config_actions, config_baseline, want
):
    """The config's study (its sweeps named ``<name>@<budget>``) and compare's (its swept labels
    ``LABEL@b``) set the same actions against the same baselines."""
    text, baseline, budgets = compare_args
    before, base = with_baseline(parse_actions(text), baseline)
    swept, sweep = sweep_budgets(before, parse_budgets(budgets), base)
    compare = contrast_pairs(swept, base, sweep, baseline_method(before, base))
    pipeline = baseline_pairs(_study(config_actions, config_baseline), "s")
    assert compare == pipeline == want


def test_an_action_outside_a_swept_baselines_grid():
    """Where the two differ, by design (kvdiverge.config.baselines.paired_baselines): a prompt
    transformation takes no budget, so it is outside the sweep; the config's study still holds
    its baseline as named and sets it against that, while compare's swept baseline left no
    action of its label, so compare sets it against none."""
    before, base = with_baseline(parse_actions("q=quantize@4bit,snapkv=snapkv@0.5"), "snapkv")
    swept, sweep = sweep_budgets(before, parse_budgets("0.25,0.5"), base)
    assert contrast_pairs(swept, base, sweep, baseline_method(before, base)) == {}
    config = _study(
        {
            "q": {"selector": "quantize", "bits": 4},
            "snapkv": {"selector": "snapkv", "budgets": [0.25, 0.5]},
        },
        "snapkv@0.25",
    )
    assert baseline_pairs(config, "s") == {"q": "snapkv@0.25"}
