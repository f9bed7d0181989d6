"""Extreme values in a configuration: each refused at parse time (before any model
loads) in one line naming the field the user wrote and the bound: a temperature of 1e-320
(NaN kernels), K of 10**12 (a trajectory file's rows), rollout.H: 3 (the analysis clock, named
by what the user wrote), kvpress window_size, kernel_size or lag_size of 0."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import yaml

from kvdiverge.config import ConfigError, check_config
from kvdiverge.eviction import ActionError, parse_action
from kvdiverge.pipeline.extremes import MAX_FILE_ROWS, MIN_TEMPERATURE, temperature_problem
from kvdiverge.theory.coupling import tempered_kernel

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
TINY = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())


def refusal(**changes) -> str:
    cfg = copy.deepcopy(TINY)
    for dotted, value in changes.items():
        *path, key = dotted.split("__")
        node = cfg
        for part in path:
            node = node.setdefault(part, {})
        node[key] = value
    with pytest.raises(ConfigError) as info:
        check_config(cfg, SCHEMA)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_the_bound_is_where_the_kernel_breaks_not_above_it():
    """Below the bound the kernel is NaN for some T (1e-320: every finite logit overflows); at
    the bound it is a finite law that sums to 1, for logits far larger than any model's."""
    logits = torch.tensor([[30.0, 29.5, -40.0, 12.0]])
    assert torch.isnan(tempered_kernel(logits, 1e-320)).any()
    law = tempered_kernel(logits * 1e3, MIN_TEMPERATURE)
    assert torch.isfinite(law).all() and math.isclose(float(law.sum()), 1.0)


def test_a_subnormal_temperature_is_refused_at_parse_time():
    assert refusal(rollout__temperature=1e-320) == (
        "config.rollout.temperature: 1e-320 is below 1e-06; expected 0 (greedy) or a "
        "temperature >= 1e-06: below it softmax(logits / T) is the argmax up to rounding, and "
        "as T nears 0 logits / T overflow (NaN kernels); use 0 for greedy decoding"
    )


def test_the_rollout_settings_and_compare_refuse_it_too():
    from kvdiverge.compare.actions import CompareError
    from kvdiverge.compare.inputs import check_numbers
    from kvdiverge.engine import RolloutSettings

    with pytest.raises(ValueError, match=r"^temperature: 1e-320 is below 1e-06"):
        RolloutSettings(H=4, seed=0, temperature=1e-320)
    with pytest.raises(CompareError, match=r"^--temperature: 1e-320 is below 1e-06"):
        check_numbers(2, 8, 10, 0.95, 1e-320)
    assert temperature_problem(0, "t") is None and temperature_problem(MIN_TEMPERATURE, "t") is None


def test_a_huge_K_is_refused_at_parse_time_with_its_bound():
    message = refusal(studies__study1__K=10**12)
    n = max(TINY["datasets"]["cohorts"].values())
    H = TINY["rollout"]["H"]
    assert message == (
        f"config.studies.study1.K: 1000000000000 replicates of the {n} documents of cohort "
        f"study1 at rollout.H = {H} are {10**12 * H * n} rows in one trajectory file; expected "
        f"at most {MAX_FILE_ROWS // (H * n)} replicates (a file holds at most {MAX_FILE_ROWS} "
        "rows)"
    )


@pytest.mark.parametrize("key", ["K_dev", "K_control"])
def test_huge_development_and_control_replicates_are_refused(key):
    assert refusal(**{f"studies__study1__{key}": 10**12}).startswith(
        f"config.studies.study1.{key}: 1000000000000 replicates"
    )


def test_a_huge_plan_bound_is_refused():
    assert refusal(analysis__planning__max_K=10**12).startswith(
        "config.analysis.planning.max_K: 1000000000000 replicates"
    )


def test_a_short_horizon_is_named_by_what_the_user_wrote():
    assert refusal(rollout__H=3) == (
        "config.rollout.H: 3 is too short for the analysis clock: analysis.clock.branch_depth "
        "0.5 (a fraction of H) makes 2 steps, and branch_depth must lie in 1..H/2 = 1 "
        "(τ + j ≤ H); expected rollout.H >= 4, or another analysis.clock.branch_depth"
    )


def test_the_smallest_horizon_named_is_accepted():
    cfg = copy.deepcopy(TINY)
    cfg["rollout"]["H"] = 4
    cfg.setdefault("analysis", {})["clock"] = {}
    check_config(cfg, SCHEMA)  # the H the refusal of H = 3 names


@pytest.mark.parametrize(
    ("press", "key"),
    [
        ("SnapKVPress", "window_size"),
        ("SnapKVPress", "kernel_size"),
        ("LagKVPress", "lag_size"),
        ("PyramidKVPress", "window_size"),
    ],
)
def test_kvpress_sizes_of_zero_are_refused_at_parse_time(press, key):
    spec = {"selector": "kvpress", "budget": 0.5, "press": press, "press_kwargs": {key: 0}}
    with pytest.raises(ActionError) as info:
        parse_action(spec, name="p")
    assert str(info.value) == (
        f"actions.p.press_kwargs.{key}: {press}'s {key} is 0; expected an integer >= 1"
    )
