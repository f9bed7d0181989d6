"""The rules the pipeline's config and ``kvdiverge compare`` share come from one place
(kvdiverge.config): a decoding temperature (``rollout.temperature`` and ``--temperature``) and a
sweep's budgets (``actions.<name>.budgets`` and ``--budgets``) are refused in the same cases,
each with its own field's name."""

from __future__ import annotations

import math

import pytest

from kvdiverge.compare import CompareError
from kvdiverge.compare.actions import parse_budgets
from kvdiverge.compare.inputs import check_numbers
from kvdiverge.config import actions_problem, decoding_problem, is_budget

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
